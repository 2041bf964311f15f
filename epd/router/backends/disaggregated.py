"""The disaggregated backend: one request through the tiers over grpc.aio, in the order the router
alone decides (workers never call each other, except encoders pushing rows to prefill):

1. ``Prefill`` to the chosen prefill worker; its first reply says the request is registered there;
2. ``Encode`` to the encoders the items route to (by content hash); they push rows to that prefill;
3. prefill's second reply: the first token and the prompt's KV as a handle;
4. a start with that handle on the router's one stream to a decode worker (``decode_link``); the
   request's share of each engine step's message is the rest of the output.

Closing the output stream early (client gone, stop string) cancels every call still open (and sends
decode a cancel), which aborts the request on the tier that holds it; a KV handle decode never took
is released at once.

A worker lost under a request (it died, left rotation by health or progress, or failed the call)
costs the request nothing while its move budget (``max_migrations``) and deadline last: before the
first token the request is dispatched again (encoders push its rows again, from their cache);
mid-stream it **migrates**: the prompt plus every token already streamed is prefilled anew and
another decode worker goes on from there. Those tokens count as output on the workers (limits,
and a seeded draw's token index), so a greedy or seeded stream goes on token for token as if it
had never moved, and the client sees neither a gap nor a repeat.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from epd.config import RouterConfig
from epd.errors import (
    DeadlineExceeded,
    EPDError,
    ErrorCode,
    InvalidRequest,
    Overloaded,
    Unavailable,
    UpstreamError,
    code_for_grpc,
)
from epd.models.registry import family_for
from epd.models.spec import ProcessedPrompt
from epd.router.backends.base import BackendOutput, Job
from epd.router.backends.decode_link import DecodeLink, StepError
from epd.router.backends.encodes import Encodes
from epd.router.backends.moves import (
    Backoff,
    Moves,
    ProducerFailed,
    Suspects,
    WorkerLost,
    blaming_producer,
    unless_lost,
)
from epd.router.backends.picking import Picker
from epd.router.backends.store_reads import StoreReads
from epd.router.discovery import DnsDiscovery, Resolver, resolve_service
from epd.router.routing import ROUTING_POLICIES
from epd.router.workers import TIERS, WorkerRegistry, WorkerState
from epd.transport.choose import needs_same_host
from epd.v1 import common_pb2, decode_pb2, encoder_pb2, prefill_pb2, tensor_pb2, tensor_pb2_grpc
from epd.wire.protocol import logprobs_from_proto, multimodal_item, request_metadata
from epd.wire.rpc import retry_after_s
from epd.wire.tls import MutualTls

log = logging.getLogger("epd.router")
_PREFIX_KEY_TOKENS = 64  # how much of the prompt decides prefill affinity
_ENCODE_ATTEMPTS = 2
_ENCODE_REPLY_GRACE_S = 2.0  # after prefill's result: an encoder's reply, already on its way
_ROTATION_POLL_S = 0.2  # how often a request waiting to move looks for a worker back in rotation
_RELEASE_TIMEOUT_S = 5.0
# what a tier said about the request itself keeps its meaning; anything else is that tier failing it
_PASSED_THROUGH = {ErrorCode.INVALID_ARGUMENT: InvalidRequest, ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded}


class DisaggregatedBackend:
    def __init__(self, config: RouterConfig, model_dir: str | Path, *, resolve: Resolver = resolve_service) -> None:
        """``resolve``: how the ``*_service`` names become addresses (DNS; tests pass their own)."""
        self.config = config
        self._resolve = resolve
        self.discovery: DnsDiscovery | None = None
        # rows leave the encoders in float32 (their default dtype): what admission's byte budget counts
        self.embedding_row_bytes = family_for(model_dir).mm_spec(Path(model_dir)).embedding_dim * 4
        self.workers = WorkerRegistry({"encoder": list(config.encoders), "prefill": list(config.prefills),
                                       "decode": list(config.decodes)}, health_period_s=config.health_period_s,
                                      health_timeout_s=config.health_timeout_s,
                                      stall_timeout_s=config.stall_timeout_s,
                                      tls=MutualTls.from_config(config.tls))
        self.policies = {tier: ROUTING_POLICIES.get(getattr(config, f"{tier}_policy"))() for tier in TIERS}
        self.picker = Picker(self.workers, self.policies)
        # content hash -> (encoder address, number of encode calls carrying it now): an item already
        # being encoded goes to that encoder, where it waits on the one producer instead of being
        # encoded again elsewhere because its home looked busy
        self._encoding: dict[str, tuple[str, int]] = {}
        self.moves: collections.Counter[str] = collections.Counter()  # requests moved, by stage
        # tensors handed from tier to tier, by (stage, placement): same_host (shm / CUDA IPC) or
        # cross_host (inline / NCCL), as the router placed the pair
        self.handoffs: collections.Counter[tuple[str, str]] = collections.Counter()
        self._background: set[asyncio.Task] = set()  # calls sent on behalf of requests that are gone
        self.suspects = Suspects()  # encoders whose rows prefill could not import: every request passes them over
        self.store_reads = StoreReads(config.prefill_store_reads)  # items prefill reads from the encoders' store
        self.decode_links: dict[str, DecodeLink] = {}  # decode address -> the one stream its requests share

    async def start(self) -> None:
        await self.workers.start()
        services = {tier: name for tier in TIERS if (name := getattr(self.config, f"{tier}_service"))}
        if services:
            self.discovery = DnsDiscovery(self.workers, services, period_s=self.config.discovery_period_s,
                                          drain_timeout_s=self.config.discovery_drain_timeout_s,
                                          expected_model=self.config.model, resolve=self._resolve)
            await self.discovery.start()

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        if self._background:  # releases still on their way: let them reach the workers first
            await asyncio.wait(set(self._background), timeout=_RELEASE_TIMEOUT_S)
            for task in self._background:
                task.cancel()
        await asyncio.gather(*(link.close() for link in self.decode_links.values()))
        await self.workers.close()

    def _in_background(self, coro) -> None:
        """Run ``coro`` without waiting for it (the caller may be cancelled), kept until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def health(self) -> dict:
        counts = self.workers.healthy_counts()
        ok = all(counts.get(tier, 0) > 0 for tier in TIERS)
        workers = {tier: [w.as_dict() for w in states] for tier, states in self.workers.workers.items()}
        for worker in workers.get("encoder", []):
            if paused_s := self.suspects.remaining_s(worker["address"]):
                worker["passed_over_s"] = round(paused_s, 1)  # its rows could not be imported lately
        return {"status": "ok" if ok else "degraded", "workers": workers}

    def engine_max_model_len(self) -> int | None:
        """The longest request every healthy prefill and decode worker takes (None before any says)."""
        lengths = [w.last_health.max_model_len for tier in ("prefill", "decode")
                   for w in self.workers.workers.get(tier, []) if w.healthy and w.last_health.max_model_len]
        return min(lengths) if lengths else None

    def refresh_metrics(self, metrics) -> None:
        metrics.refresh_cluster(self.workers.workers)
        metrics.refresh_moves(self.moves)
        metrics.refresh_handoffs(self.handoffs, self.store_reads.num_missed)

    # ---- one request ----------------------------------------------------------------------------
    async def run(self, job: Job) -> AsyncIterator[BackendOutput]:
        backoff = Backoff(job, self.config.queue_timeout_s)
        moves = Moves(job, self.config.max_migrations)
        await self._until_in_rotation(job, backoff, reason="")  # a tier restarting: wait for it, not 503
        while True:
            try:
                avoid = moves.avoid | self.suspects.current()
                async with contextlib.aclosing(self._attempt(moves.job, backoff, avoid)) as outputs:
                    async for output in outputs:
                        moves.streamed(output)
                        yield output
                return
            except UpstreamError as err:  # a tier lost or failed the request: move it, if it may
                if isinstance(err, ProducerFailed):
                    log.warning("encoder %s: prefill could not import its rows; every request passes it over "
                                "for %.0f s", err.producer, self.suspects.blame(err.producer))
                stage = moves.move(err)
                self.moves[stage] += 1
                log.warning("request %s: %s; moving it (%s, %d tokens streamed)", job.request_id, err.message,
                            stage, len(moves.job.output_token_ids))
                await self._until_in_rotation(moves.job, backoff, reason=" to move it to")

    async def _attempt(self, job: Job, backoff: Backoff, avoid: set[str]) -> AsyncIterator[BackendOutput]:
        """``avoid``: encoders to pass over while others are in rotation (their rows failed this request
        before, or any request lately)."""
        while True:
            # prefill stays counted (and reachable while drained) until decode took its KV or let go
            with self.picker.holding("prefill", _prefix_key(job.prompt)) as prefill:
                try:
                    result = await self._prefill(job, prefill, backoff, avoid)
                except Overloaded as err:  # that prefill is full: wait its hint, then ask again
                    await backoff.wait(err)
                    continue
                async with contextlib.aclosing(self._after_prefill(job, prefill, result, backoff)) as outputs:
                    async for output in outputs:
                        yield output
                return

    async def _until_in_rotation(self, job: Job, backoff: Backoff, reason: str) -> None:
        """Before the first dispatch and before a move: every tier the request needs has a worker in
        rotation, or one comes back (a restarted worker, a node's actors placed again) within the
        queue budget and the deadline; else 503. /health says ``degraded`` meanwhile."""
        tiers = TIERS if job.prompt.items else ("prefill", "decode")
        while missing := [tier for tier in tiers if not self.workers.candidates(tier)]:
            if not await backoff.pause(_ROTATION_POLL_S):
                raise Unavailable(f"request {job.request_id}: no healthy {missing[0]} worker{reason} "
                                  f"({len(self.workers.workers[missing[0]])} configured)")

    async def _after_prefill(self, job: Job, prefill: WorkerState, result: common_pb2.PrefillResult,
                             backoff: Backoff) -> AsyncIterator[BackendOutput]:
        is_finished = bool(result.finish_reason)
        try:
            first_logprobs = [logprobs_from_proto(result.first_logprobs)] if result.HasField("first_logprobs") else []
            yield BackendOutput([result.first_token_id], first_logprobs, result.finish_reason or None,
                                result.num_cached_tokens)
            if is_finished:
                return
            async with contextlib.aclosing(self._decode(job, prefill, result, backoff)) as outputs:
                async for output in outputs:
                    is_finished = bool(output.finish_reason)
                    yield output
        finally:
            if not is_finished and result.kv.lease_id:  # decode failed, or never started (client gone,
                # no decode worker); a handle without a lease carried its bytes: nothing is held
                self._in_background(_release(prefill, tensor_pb2.ReleaseRequest(lease_ids=[result.kv.lease_id]),
                                             f"KV lease {result.kv.lease_id}"))

    async def _prefill(self, job: Job, prefill: WorkerState, backoff: Backoff,
                       avoid: set[str]) -> common_pb2.PrefillResult:
        meta = request_metadata(job.request_id, job.prompt, job.sampling, job.eos_token_ids,
                                output_token_ids=job.output_token_ids)
        release_key = secrets.token_hex(16)  # names this call's KV export at prefill (see the finally)
        stored = self.store_reads.pick(job.request_id, [item.mm_hash for item in job.prompt.items], prefill,
                                       self.picker.encoder_hosts) if job.prompt.items else []
        request = prefill_pb2.PrefillRequest(request=meta, kv_transport=self.config.transport,
                                             kv_consumer_host_id=self.picker.kv_consumer_host(prefill),
                                             kv_release_key=release_key, stored=stored)
        self.handoffs["embeddings", "store"] += len(stored)
        call = prefill.stub.Prefill(request, timeout=job.remaining_s())
        encodes, result, reader = Encodes(), None, None
        encoded_on: dict[int, str] = {}  # item index -> the encoder its rows come from
        try:
            accepted = await unless_lost(prefill, call.read())
            if accepted is grpc.aio.EOF or not accepted.HasField("accepted"):
                raise UpstreamError(f"prefill {prefill.address} did not accept request {job.request_id}")
            # registered there: from now on the encoders may push its rows (prefill reads the stored ones)
            pushed = sorted(set(range(len(job.prompt.items))) - {push.item_index for push in stored})
            refresh_store = False
            while True:
                self._encode_items(job, pushed, prefill, backoff, encodes, encoded_on, avoid, refresh_store)
                reply = await encodes.race(reader := asyncio.ensure_future(call.read()), prefill)
                if reply is grpc.aio.EOF or not reply.HasField("store_misses"):
                    break
                pushed, refresh_store = list(reply.store_misses.item_indices), True  # not in the store after all
                for index in pushed:
                    self.store_reads.forget(job.prompt.items[index].mm_hash)
            if reply is grpc.aio.EOF or not reply.HasField("result"):
                raise UpstreamError(f"prefill {prefill.address} ended request {job.request_id} without a result")
            result = reply.result
            # every row prefill needed has arrived: an encode call still running waits only for its
            # reply (what the store has, for the next request), and holds its encoder meanwhile
            encodes.settle(_ENCODE_REPLY_GRACE_S)
            return result
        except grpc.aio.AioRpcError as err:
            raise blaming_producer(self._rpc_error("prefill", prefill.address, err), encoded_on) from None
        finally:
            if result is None:  # prefill aborts the request when its call is cancelled
                encodes.cancel()
                call.cancel()
                if reader is not None:  # a call prefill never accepted exported nothing
                    reader.cancel()
                    # a result already exported (read, in flight, or unread in the call's buffer) has
                    # no other owner: free it by this call's key. Sent after the cancel on the same
                    # channel; an export still being made when the cancel lands is freed by prefill
                    self._in_background(_release(prefill, tensor_pb2.ReleaseRequest(consumer_keys=[release_key]),
                                                 "the KV of a given-up call"))

    def _encode_items(self, job: Job, indices: list[int], prefill: WorkerState, backoff: Backoff,
                      encodes: Encodes, encoded_on: dict[int, str], avoid: set[str], refresh_store: bool) -> None:
        """Start the encode calls of the request's items ``indices`` (pushed to ``prefill``);
        ``refresh_store``: prefill could not read them from the store, the encoders put them again."""
        for address, group in self._encoder_groups(job.prompt, avoid, indices).items():
            encodes.add(self._encode_on(address, job, group, prefill.address, backoff, encoded_on, avoid,
                                        refresh_store),
                        self._producing(address, [job.prompt.items[i].mm_hash for i in group]))

    def _encoder_groups(self, prompt: ProcessedPrompt, avoid: set[str] = frozenset(),
                        indices: list[int] | None = None) -> dict[str, list[int]]:
        """Items (``indices``, default all) by the encoder their content hash routes to: a repeated
        image finds its cache. Encoders in ``avoid`` are passed over while another one is in rotation."""
        groups: dict[str, list[int]] = {}
        healthy = {c.address for c in self.picker.encoders(avoid)}
        for index in range(len(prompt.items)) if indices is None else indices:
            item = prompt.items[index]
            producing = self._encoding.get(item.mm_hash, ("", 0))[0]
            address = producing if producing in healthy else self.picker.pick("encoder", item.mm_hash, is_started=True,
                                                                         avoid=avoid)
            groups.setdefault(address, []).append(index)
        return groups

    def _producing(self, address: str, hashes: list[str]):
        """Note that ``address`` is encoding these items; -> the callback that un-notes them."""
        for mm_hash in hashes:
            self._encoding[mm_hash] = (address, self._encoding.get(mm_hash, ("", 0))[1] + 1)

        def done(_) -> None:
            for mm_hash in hashes:
                home, count = self._encoding.pop(mm_hash)
                if count > 1:
                    self._encoding[mm_hash] = (home, count - 1)
        return done

    async def _encode_on(self, address: str, job: Job, indices: list[int], prefill_address: str,
                         backoff: Backoff, encoded_on: dict[int, str], avoid: set[str], refresh_store: bool) -> None:
        items = [multimodal_item(i, job.prompt.items[i], with_media=True) for i in indices]
        prefill_host = self.workers.get("prefill", prefill_address).host_id
        request = encoder_pb2.EncodeRequest(request_id=job.request_id, items=items, prefill_address=prefill_address,
                                            transport=self.config.transport, consumer_host_id=prefill_host,
                                            refresh_store=refresh_store)
        unavailable = 0
        while True:
            encoded_on.update(dict.fromkeys(indices, address))
            with self.picker.holding("encoder", address=address) as encoder:
                self.handoffs["embeddings", _placement(encoder.host_id, prefill_host)] += len(indices)
                try:
                    reply = await unless_lost(encoder, encoder.stub.Encode(request, timeout=job.remaining_s()))
                    self.store_reads.learn((job.prompt.items[i].mm_hash for i in reply.item_indices), reply.in_store,
                                           address)
                    return
                except grpc.aio.AioRpcError as err:
                    error = self._rpc_error("encoder", address, err)
                    is_lost = err.code() == grpc.StatusCode.UNAVAILABLE
                except WorkerLost as err:
                    error, is_lost = err, True
            if isinstance(error, Overloaded):  # full: wait its hint; then the same or a quieter encoder
                await backoff.wait(error)
            elif not is_lost or (unavailable := unavailable + 1) == _ENCODE_ATTEMPTS:
                raise error
            # a restarted worker's first call can fail on the old connection; try again, on another
            # encoder when one is healthy
            others = [c for c in self.picker.encoders(avoid) if c.address != address]
            if others:
                address = self.policies["encoder"].pick(job.prompt.items[indices[0]].mm_hash, others)

    async def _decode(self, job: Job, prefill: WorkerState, result: common_pb2.PrefillResult,
                      backoff: Backoff) -> AsyncIterator[BackendOutput]:
        meta = request_metadata(job.request_id, job.prompt, job.sampling, job.eos_token_ids, with_items=False,
                                output_token_ids=job.output_token_ids)
        request = decode_pb2.GenerateRequest(request=meta, prefill=result)
        # KV in prefill's shared memory (or GPU) can only go to a decode worker on prefill's host
        host_id = prefill.host_id if needs_same_host(result.kv) else None
        while True:
            with self.picker.holding("decode", job.request_id, host_id=host_id, is_started=True) as decode:
                self.handoffs["kv", _placement(prefill.host_id, decode.host_id)] += 1
                link = self._link(decode)
                channel = link.start(request, job.remaining_s())
                is_finished, is_started = False, False
                try:
                    while not is_finished:
                        output = await channel.next()
                        is_finished, is_started = output.finish_reason is not None, True
                        yield output
                    return
                except StepError as err:  # decode failed this request alone
                    error = self._tier_error("decode", decode.address, err.status, err.message, err.retry_after_s)
                    if is_started or not isinstance(error, Overloaded):
                        raise error from None
                finally:
                    if not is_finished:
                        link.cancel(job.request_id)  # decode aborts the request
            await backoff.wait(error)  # that decode worker is full: wait its hint, then ask again

    def _link(self, decode: WorkerState) -> DecodeLink:
        """The one stream to ``decode`` every request there shares (a restarted worker: a new one)."""
        link = self.decode_links.get(decode.address)
        if link is None or link.worker is not decode:
            if link is not None:  # the address was removed and added again: a new worker state
                self._in_background(link.close())
            link = self.decode_links[decode.address] = DecodeLink(
                decode, lambda err: self._rpc_error("decode", decode.address, err),
                over_tcp=self.config.decode_link == "tcp", wake_every=self.config.stream_interval)
        return link

    def _rpc_error(self, tier: str, address: str, err: grpc.aio.AioRpcError) -> EPDError:
        return self._tier_error(tier, address, err.code(), err.details(), retry_after_s(err))

    def _tier_error(self, tier: str, address: str, status: grpc.StatusCode, details: str | None,
                    hint_s: float | None = None) -> EPDError:
        """What a worker's failed call (or a request failed on a stream) means for the request."""
        if status == grpc.StatusCode.UNAVAILABLE:
            self.workers.mark_failed(tier, address)
        if status == grpc.StatusCode.RESOURCE_EXHAUSTED and hint_s is not None:
            return Overloaded(f"{tier} {address}: {details}", retry_after_s=hint_s)
        details = details or status.name
        error_type = _PASSED_THROUGH.get(code_for_grpc(status))
        if error_type is not None:  # the client's own doing: its answer names no worker of ours
            log.info("%s %s refused a request: %s", tier, address, details)
            return error_type(f"{tier}: {details}")
        return UpstreamError(f"{tier} {address} failed the request: {details}")


def _placement(producer_host_id: str, consumer_host_id: str) -> str:
    return "same_host" if producer_host_id == consumer_host_id else "cross_host"


async def _release(worker: WorkerState, request: tensor_pb2.ReleaseRequest, what: str) -> None:
    """Give tensors back to the worker that made them (a KV decode never took, the export of a call
    given up: ``consumer_keys``): no wait for their TTL, which remains the backstop."""
    try:
        await tensor_pb2_grpc.TensorStoreStub(worker.channel).Release(request, timeout=_RELEASE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        log.debug("could not release %s at %s: %s", what, worker.address, err.code())
    except grpc.aio.UsageError:  # its channel was closed (the worker removed, the router stopping)
        log.debug("could not release %s at %s: channel closed", what, worker.address)


def _prefix_key(prompt: ProcessedPrompt) -> str:
    head = prompt.prompt_token_ids[:_PREFIX_KEY_TOKENS]
    hashes = [i.mm_hash for i in prompt.items if i.offset < _PREFIX_KEY_TOKENS]
    return ",".join(map(str, head)) + "|" + ",".join(hashes)
