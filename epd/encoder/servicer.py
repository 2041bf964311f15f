"""gRPC face of the encoder tier (grpc.aio): runs items through the EncoderEngine, exports each
item's rows as a tensor handle and pushes the handles straight to the request's prefill worker.

Exports run on the io pool and pushes on the event loop, never on the engine's thread: the vision
tower keeps computing while earlier results travel. Pushes bound for one prefill worker share
calls (``PushBatcher``)."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from epd.config import ConfigError
from epd.encoder.engine import EncoderEngine
from epd.encoder.item_scheduler import EncoderItem
from epd.encoder.shared_store import SharedEncoderStore
from epd.errors import Cancelled, DeadlineExceeded, EPDError, InvalidRequest, UpstreamError, as_epd_error
from epd.loops import wait_for_future
from epd.multimodal.hashing import hash_encoded_media, hash_processor_kwargs
from epd.multimodal.media import MODALITIES
from epd.multimodal.processor_kwargs import MediaSettings
from epd.transport import choose_transport
from epd.transport.base import wait_for_producer
from epd.transport.choose import is_same_host
from epd.transport.shm import shared_empty
from epd.transport.store import store_handle
from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc, tensor_pb2
from epd.wire.rpc import MAX_MESSAGE_BYTES, abort_with_async, open_channel, remaining_s
from epd.wire.tls import process_tls

log = logging.getLogger("epd.encoder")


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, engine: EncoderEngine, ctx) -> None:
        self.engine, self.ctx = engine, ctx
        self.store, self.config, self.metrics = ctx.store, ctx.config, ctx.metrics
        self.pusher = PushBatcher(self.config.model,
                                  release=lambda ids, unused: self.store.release(ids, unused=unused))

    async def Encode(self, request, context):
        try:
            with self.ctx.admission.hold():
                reply = await self._encode(request, context)
        except EPDError as err:
            self.metrics.count_failure(err)
            await abort_with_async(context, err)
        self.metrics.requests.labels("ok").inc()
        return reply

    async def _encode(self, request, context) -> encoder_pb2.EncodeResponse:
        request_id = request.request_id
        # one request's items may reach this encoder in several calls (its own group, and another
        # encoder's group retried here after that encoder was lost): the engine keys each call
        key = f"{request_id}@{min((m.item_index for m in request.items), default=0)}"
        timeout_s = remaining_s(context, self.config.request_timeout_s)
        # a stranger's call must cost nothing: the destination is checked before any encoding, and
        # the cache key is hashed here from the bytes (a caller's content_hash is only a label, so
        # nobody can store one image's embeddings under another image's key)
        await self.pusher.check_destination(request.prefill_address, timeout_s)
        try:
            items = await self.ctx.blocking(lambda: [_item(msg, self.engine.model_id, self.engine.media)
                                                     for msg in request.items])
            future = self.engine.submit(key, items)
        except ValueError as err:  # can never be encoded under this worker's budgets, or malformed items
            raise InvalidRequest(f"request {request_id}: {err}") from None
        try:  # a router cancelling the call frees the request's place in the queue and its pins
            result = await self._result(request_id, future, timeout_s)
            pushes = await self.ctx.blocking(lambda: self._export_all(request, result),
                                             undo=lambda made: self.store.release([p.embedding.lease_id for p in made], unused=True))
        finally:
            self.engine.release(key)  # the handles hold the rows' memory (a lease, or a copy) from here
        try:  # a push that fails (or is never sent) gives its leases back itself
            await self.pusher.push(request.prefill_address, pushes, remaining_s(context, timeout_s))
        except Exception as err:  # noqa: BLE001 - the push failed: the rows will never be used
            if isinstance(err, InvalidRequest):
                raise InvalidRequest(f"request {request_id}: {err.message}") from None
            why = f"{err.details() or err.code().name}" if isinstance(err, grpc.aio.AioRpcError) else repr(err)
            raise UpstreamError(f"request {request_id}: pushing to prefill at {request.prefill_address} failed: "
                                f"{why}") from None
        self.metrics.encoded_tokens.inc(sum(m.encoder_tokens for m, hit in zip(request.items, result.cache_hits)
                                            if not hit))
        in_store = [] if self.engine.shared_store is None else await self.ctx.blocking(
            lambda: store_hints(self.engine, items, result, request.refresh_store))
        return encoder_pb2.EncodeResponse(item_indices=[m.item_index for m in request.items],
                                          cache_hits=result.cache_hits, in_store=in_store)

    @staticmethod
    async def _result(request_id: str, future, timeout_s: float):
        if not await wait_for_future(future, timeout_s):
            raise DeadlineExceeded(f"request {request_id}: not encoded in time")
        if future.cancelled():
            raise Cancelled(f"request {request_id}: cancelled")
        if future.exception() is not None:
            raise as_epd_error(future.exception())
        return future.result()

    def _export_all(self, request, result) -> list[common_pb2.EmbeddingPush]:
        """On an io thread: a lease per item (rows made in shared memory, or on the GPU for CUDA IPC);
        a copy only when the transport needs one (inline, or rows outside the store's memory)."""
        made = []
        try:
            events = result.ready_events or [None] * len(result.embeddings)
            for msg, rows, ready in zip(request.items, result.embeddings, events):
                made.append(self._export(request, msg.item_index, rows, ready))
        except BaseException:
            self.store.release([p.embedding.lease_id for p in made], unused=True)
            raise
        return made

    def _export(self, request, item_index: int, rows, ready_event=None) -> common_pb2.EmbeddingPush:
        transport = choose_transport(rows.device.type, is_same_host(self.ctx.host_id, request.consumer_host_id),
                                     override=request.transport or self.config.transport or None)
        with self.metrics.time_transfer(transport, "export", rows.nbytes):
            handle = self.store.export(rows, transport=transport, ttl_s=self.config.lease_ttl_s,
                                       ready_event=ready_event)
        return common_pb2.EmbeddingPush(request_id=request.request_id, item_index=item_index, embedding=handle)

    async def Health(self, request, context):
        stats = self.engine.stats()
        return self.ctx.health(num_running=stats.num_held_requests, num_waiting=stats.num_waiting_requests,
                               num_encoder_forwards=stats.num_forwards, num_encoded_items=stats.num_encoded_items,
                               num_steps=stats.num_forwards, busy_seconds=self.engine.busy.now(),
                               uses_encoder_store=self._uses_store())

    def _uses_store(self) -> bool:
        shared = self.engine.shared_store
        return shared is not None and shared.ready()


def store_hints(engine: EncoderEngine, items: list[EncoderItem], result, refresh: bool) -> list:
    """Per item, a ``store`` handle of its rows where the cluster's store has them (the router
    may have prefill read them there next time), else an empty handle; nothing without a store.
    ``refresh``: prefill could not read them there: put them again (a hit in this encoder's own
    cache never looks at the store, so a damaged entry would stay and fail every read). An item
    whose rows this encoder holds and the store is not known to (encoded while the store was
    down or not joined yet, or forgotten since) is put too, once the store is up: else it would
    never reach the store while this encoder's own cache keeps hitting it."""
    shared = engine.shared_store
    if shared is None:
        return []
    handles = []
    events = result.ready_events or [None] * len(result.embeddings)
    for item, rows, ready in zip(items, result.embeddings, events):
        key = engine.scheduler.cache_key(item)
        name = shared.holds(key, rows.dtype)
        if refresh or (name is None and shared.ready()):
            # cache rows are never written again: the put thread may read them later
            wait_for_producer(rows, ready)  # CUDA: after the batch that wrote them
            shared.put(key, rows.to("cpu") if rows.is_cuda else rows)
            name = shared.holds(key, rows.dtype)
        handles.append(store_handle(name, rows) if name else tensor_pb2.TensorHandle())
    return handles


_MAX_BATCH_BYTES = MAX_MESSAGE_BYTES // 2  # one call's pushes; handles are small unless inline
_CHECK_TIMEOUT_S = 5.0  # a prefill's health answer before its first push


@dataclass
class _QueuedPush:
    pushes: list
    delivered: asyncio.Future
    deadline_s: float  # event-loop time
    nbytes: int


class PushBatcher:
    """Pushes to prefill workers, in as few calls as possible: what is queued for a worker while a
    call to it is in flight leaves together in the next call (under a burst, the results of one
    encoder batch). A caller cancelled meanwhile does not withdraw its pushes: they go, and a
    prefill that no longer holds the request sends their leases back. The batcher owns the leases
    of what it is given until prefill takes them: it ``release``s those prefill refused or was
    never sent (``unused=True``: nobody imported them) and those of a call that failed
    (``unused=False``: prefill may have imported some before the failure), whether or not their
    caller still waits.

    Users' embeddings go only to EPD prefill workers of this model: before its first push to an
    address, the batcher asks it for its health and refuses (``InvalidRequest``) an address that
    answers as anything else, so an Encode call naming a stranger's address sends it nothing."""

    def __init__(self, model: str, *,
                 release: Callable[[list[str], bool], object] = lambda lease_ids, unused: None) -> None:
        self.model, self._release = model, release
        self._queued: dict[str, list[_QueuedPush]] = {}
        self._sending: set[str] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._checked: dict[str, asyncio.Future] = {}  # address -> its check (done: a verified prefill)

    async def push(self, address: str, pushes: list, timeout_s: float) -> None:
        """Deliver ``pushes`` to the prefill worker at ``address``; raises its call's AioRpcError,
        or ``InvalidRequest`` when ``address`` is not a prefill worker of this model."""
        try:
            await self.check_destination(address, timeout_s)
        except BaseException:  # refused, or the caller left: nothing was sent
            self._release([p.embedding.lease_id for p in pushes], True)
            raise
        loop = asyncio.get_running_loop()
        delivered = loop.create_future()
        delivered.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even when nobody waits
        queued = _QueuedPush(pushes, delivered, loop.time() + timeout_s, sum(p.ByteSize() for p in pushes))
        self._queued.setdefault(address, []).append(queued)
        if address not in self._sending:
            self._sending.add(address)
            loop.create_task(self._send(address))
        await asyncio.shield(delivered)  # a caller cancelled here leaves its pushes to the batch

    async def check_destination(self, address: str, timeout_s: float) -> None:
        """Raise ``InvalidRequest`` unless ``address`` answers as a prefill worker of this model."""
        check = self._checked.get(address)
        if check is None:  # one check per address, shared by the pushes that wait for it
            check = self._checked[address] = asyncio.ensure_future(self._ask_health(address, timeout_s))
            check.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                    or self._checked.pop(address, None))  # a failed check is asked again
        await asyncio.shield(check)

    async def _ask_health(self, address: str, timeout_s: float) -> None:
        try:
            health = await prefill_pb2_grpc.PrefillStub(self._channel(address)).Health(
                common_pb2.HealthRequest(), timeout=max(0.001, min(timeout_s, _CHECK_TIMEOUT_S)))
            answer = f"as a {health.tier or 'nameless'} worker of model {health.model!r}"
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise  # down or slow: the push fails like any other, and the router moves the request
            health, answer = None, "without EPD's prefill service"
        if health is None or health.tier != "prefill" or health.model != self.model:
            raise InvalidRequest(f"prefill_address {address} is not a prefill worker of model {self.model!r} "
                                 f"(it answered {answer}): nothing pushed", param="prefill_address")

    async def _send(self, address: str) -> None:
        try:
            while self._queued.get(address):
                await self._send_batch(address, self._take(address))
        finally:
            self._sending.discard(address)

    def _take(self, address: str) -> list[_QueuedPush]:
        """What is queued for ``address``, up to the byte cap (inline handles carry their bytes)."""
        queued, batch, nbytes = self._queued[address], [], 0
        while queued and (not batch or nbytes + queued[0].nbytes <= _MAX_BATCH_BYTES):
            batch.append(queued.pop(0))
            nbytes += batch[-1].nbytes
        if not queued:
            del self._queued[address]
        return batch

    async def _send_batch(self, address: str, batch: list[_QueuedPush]) -> None:
        stub = prefill_pb2_grpc.PrefillStub(self._channel(address))
        request = prefill_pb2.PushEmbeddingsRequest(pushes=[p for queued in batch for p in queued.pushes])
        timeout_s = max(queued.deadline_s for queued in batch) - asyncio.get_running_loop().time()
        try:
            reply = await stub.PushEmbeddings(request, timeout=max(0.001, timeout_s))
            if reply.refused_lease_ids:  # late: the request is gone there; the rows are ours to free
                self._release(list(reply.refused_lease_ids), True)
            error = None
        except Exception as err:  # noqa: BLE001 - every caller of the batch hears it, none hangs
            error = err
            self._release([p.embedding.lease_id for p in request.pushes], False)
        for queued in batch:
            if not queued.delivered.done():
                queued.delivered.set_exception(error) if error is not None else queued.delivered.set_result(None)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, process_tls(), aio=True)
        return self._channels[address]


def _item(msg: common_pb2.MultimodalItem, model_id: str, media: MediaSettings | None) -> EncoderItem:
    """On an io thread (hashing reads every byte). Processor kwargs are checked as the router
    checks them (``MediaSettings.with_kwargs``) before they reach the image processor or the video
    decoder, and normalized to what the router sends for them."""
    try:
        modality = msg.modality or "image"
        if modality not in MODALITIES:
            raise ValueError(f"modality must be one of {list(MODALITIES)}, got {modality!r}")
        kwargs = json.loads(msg.processor_kwargs_json) if msg.processor_kwargs_json else None
        if kwargs and media is not None:
            kwargs = media.with_kwargs(kwargs).item_kwargs(modality, media)
        return EncoderItem(data=msg.data, content_hash=hash_encoded_media(
                               msg.data, modality=modality, processor_kwargs=kwargs, model_id=model_id),
                           processor_kwargs_hash=hash_processor_kwargs(kwargs), expected_rows=msg.expected_rows,
                           encoder_tokens=msg.encoder_tokens, label=msg.content_hash, processor_kwargs=kwargs or None,
                           modality=modality)
    except (ValueError, TypeError) as err:
        raise ValueError(f"item {msg.item_index}: {err}") from None


def build(ctx):
    """The encoder tier in the scaffold (``epd.server.tier``): -> (add the servicer to a server, close)."""
    from epd.models.locate import resolve_model

    # CPU rows are made in the store's shared memory: a push over shm is then a lease, not a copy
    engine = EncoderEngine.from_model_dir(resolve_model(ctx.config.model), ctx.config.encoder,
                                          allocate_output=functools.partial(shared_empty, ctx.store),
                                          shared_store=shared_store_for(ctx.config))
    ctx.metrics.watch_encoder(engine)
    servicer = EncoderServicer(engine, ctx)
    return lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server), engine.close


def shared_store_for(config) -> SharedEncoderStore | None:
    """The cluster's encoder cache store this encoder joins (``encoder_cache_store``), or None."""
    encoder = config.encoder
    if encoder.encoder_cache_store == "local":
        return None
    if encoder.mooncake_master is None:
        raise ConfigError("encoder_cache_store mooncake needs --mooncake-master HOST:PORT (epd serve starts a "
                          "store and fills it in)")
    from epd.transport.mooncake import MooncakeBackend

    return SharedEncoderStore(MooncakeBackend(encoder.mooncake_master, host=config.host,
                                              metadata_server=encoder.mooncake_metadata_server,
                                              protocol=encoder.mooncake_protocol,
                                              device_names=encoder.mooncake_device_names),
                              claim_ttl_s=encoder.encoder_cache_claim_ttl_s)
