"""``EncoderEngine``: thread-safe front of one encoder worker.

``submit`` admits a request and returns a future; one background loop runs
``schedule → forward_items → complete`` until ``close``. A resolved request keeps its cache
entries pinned (the server holds tensor handles to them) until ``release``.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from epd.config import EncoderConfig
from epd.encoder.cache import CacheMetrics, EncoderCacheKey
from epd.encoder.cluster_cache import POLL_S, ClusterCache, Split
from epd.encoder.errors import MultimodalEncoderInputError, MultimodalEncoderRequestError
from epd.encoder.item_scheduler import (
    EncoderItem,
    MultimodalEncoderRequestState,
    MultimodalItemScheduler,
    ScheduledBatch,
    release_pins,
    resolve_output_budgets,
)
from epd.encoder.runner import EncoderModel, MultimodalEncoderRunner
from epd.encoder.shared_store import SharedEncoderStore
from epd.engine.busy import BusyClock
from epd.engine.threads import ThreadPolicy
from epd.multimodal.budget import resolve_bytes_per_mm_encoder_embedding
from epd.multimodal.geometry import image_geometry_from_bytes
from epd.multimodal.hashing import hash_encoded_media, hash_processor_kwargs
from epd.multimodal.processor_kwargs import MediaSettings
from epd.multimodal.video import video_geometry_from_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderResult:
    """Per item, in the request's order: ``[rows, hidden]`` embeddings on the encoder's device
    (shared with the cache: read-only; on a GPU they stay there and travel over CUDA IPC), whether
    the item came from the cache rather than this request's encode, and (CUDA) the event recorded
    after the batch that wrote it, for the consumer to wait on."""

    embeddings: list[torch.Tensor]
    cache_hits: list[bool]
    ready_events: list = field(default_factory=list)


@dataclass(frozen=True)
class EncoderEngineStats:
    num_forwards: int
    num_encoded_items: int
    num_waiting_requests: int
    num_held_requests: int
    cache: CacheMetrics


@dataclass
class _Pending:
    future: Future
    hold_until_release: bool
    state: MultimodalEncoderRequestState | None = None  # set once admitted


class EncoderEngine:
    def __init__(
        self,
        model: EncoderModel | Callable[[], EncoderModel],
        config: EncoderConfig,
        *,
        model_id: str,
        model_max_atomic_item_tokens: int,
        encoder_tokens_per_row: int = 1,
        bytes_per_embedding: int | None = None,
        media: MediaSettings | None = None,
        threads: ThreadPolicy | None = None,
        allocate_output: Callable | None = None,
        shared_store: SharedEncoderStore | None = None,
    ) -> None:
        """``model``: the encoder, or a zero-argument factory run on the loop thread, so that one
        thread runs every torch op of this engine (see ``epd.engine.engine_loop`` for why);
        ``threads``: the intra-op thread policy that thread applies first (default: the
        ``num_threads`` of ``config``, else the process's usable cores, see ``epd.engine.threads``);
        ``allocate_output``: where CPU outputs are kept (``epd.transport.shm.shared_empty``: zero-copy
        export over shm; default: ordinary memory); ``shared_store``: the cluster's encoder cache
        (``epd.encoder.shared_store``), looked up after this engine's own cache and before encoding,
        and given what this engine encodes. The engine closes it."""
        self.config = config
        self.shared_store = shared_store
        self.cluster: ClusterCache | None = None
        self.model_id = model_id
        self.media = media  # the checkpoint's image geometry and video sampling (items' kwargs are checked by it)
        self.num_forwards = 0
        self.num_encoded_items = 0
        self.busy = BusyClock()  # the loop's time at work: batches, their settling, the cluster's store
        self._lock = threading.Lock()  # _pending, _held, _closed
        self._pending: dict[str, _Pending] = {}
        self._held: dict[str, list[EncoderCacheKey]] = {}
        self._closed = False
        self._wakeup = threading.Condition()  # _has_work
        self._has_work = False
        make_model = (lambda: model) if hasattr(model, "encode") else model  # a model, or its factory
        built: Future[EncoderModel] = Future()
        threads = threads or ThreadPolicy(role="encoder", override=config.num_threads)
        self._thread = threading.Thread(target=self._loop, args=(make_model, threads, built), name="epd-encoder-loop",
                                        daemon=True)
        self._thread.start()
        try:
            model = built.result()
            if bytes_per_embedding is None:
                bytes_per_embedding = resolve_bytes_per_mm_encoder_embedding(model, None, config.torch_dtype)
            self.scheduler = MultimodalItemScheduler.create(
                config, model_id=model_id, model_max_atomic_item_tokens=model_max_atomic_item_tokens,
                bytes_per_embedding=bytes_per_embedding, encoder_tokens_per_row=encoder_tokens_per_row)
            self.cache = self.scheduler.cache
            self.runner = MultimodalEncoderRunner(model, self.scheduler, device=config.target_device,
                                                  allocate=allocate_output)
            self.cluster = None if shared_store is None else ClusterCache(
                shared_store, width=self.runner.expected_width, dtype=self.runner.expected_dtype,
                device=self.runner.device, bytes_per_embedding=bytes_per_embedding)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EncoderConfig | None = None, *,
                       model_id: str | None = None, allocate_output: Callable | None = None,
                       shared_store: SharedEncoderStore | None = None) -> EncoderEngine:
        """An engine over the checkpoint's own vision tower (``family_for(model_dir).load_vision``)."""
        from epd.models.registry import family_for

        model_dir = Path(model_dir)
        config = config or EncoderConfig()

        def load() -> EncoderModel:  # on the loop thread
            if config.cuda_graph_buckets and not config.target_device.startswith("cuda"):
                raise ValueError(f"cuda_graph_buckets needs a CUDA device; device={config.device!r} is "
                                 f"{config.target_device!r} in this process")
            model = family_for(model_dir).load_vision(model_dir, dtype=config.torch_dtype, device=config.target_device)
            if not config.cuda_graph_buckets:
                return model
            if getattr(model, "block_loop", None) is None:
                logger.warning("%s has no CUDA-graph block loop; cuda_graph_buckets ignored, running eager",
                               type(model).__name__)
                return model
            from epd.encoder.graphed_model import GraphedVisionEncoder
            return GraphedVisionEncoder(model, config.cuda_graph_buckets, device=config.target_device)

        media = family_for(model_dir).media_settings(model_dir)
        return cls(load, config, model_id=model_id or str(model_dir.resolve()),
                   model_max_atomic_item_tokens=media.max_item_encoder_tokens,
                   encoder_tokens_per_row=media.image.merge_size ** 2, media=media, allocate_output=allocate_output,
                   shared_store=shared_store)

    def make_item(self, data: bytes, processor_kwargs: dict | None = None, modality: str = "image") -> EncoderItem:
        """An item from encoded image or video bytes, as the router would describe it (needs the
        checkpoint's settings: build the engine with from_model_dir)."""
        if self.media is None:
            raise ValueError("make_item needs the engine's media settings; build it with from_model_dir")
        return media_item_from_bytes(data, self.media, model_id=self.model_id, processor_kwargs=processor_kwargs,
                                     modality=modality)

    # -- public API ------------------------------------------------------------------------
    def submit(self, request_id: str, items: Sequence[object], *,
               hold_until_release: bool = True) -> Future:
        """-> Future[EncoderResult]. Raises at once for a request that can never fit the budgets.

        With ``hold_until_release`` the request's cache entries stay pinned after the future
        resolves, until ``release(request_id)``.
        """
        items = [EncoderItem.coerce(item) for item in items]
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("encoder engine is closed")
            if request_id in self._pending or request_id in self._held:
                raise ValueError(f"request {request_id!r} is already submitted to this encoder")
            self._pending[request_id] = _Pending(future, hold_until_release)
        try:
            state = self.scheduler.add_request(request_id, items)
        except BaseException:
            with self._lock:
                self._pending.pop(request_id, None)
            raise
        self._pending_state(request_id, state)
        if state.is_ready:
            self._complete([state])  # all hits; idempotent if the loop got there first
        else:
            self._notify()
        return future

    def release(self, request_id: str) -> None:
        """Unpin a finished request's entries, or cancel one still waiting. Unknown ids: no-op."""
        with self._lock:
            keys = self._held.pop(request_id, None)
            pending = self._pending.pop(request_id, None) if keys is None else None
        for key in keys or ():
            self.cache.unpin(key, request_id)
        if pending is not None:
            if self.scheduler.abort_request(request_id) is None and pending.state is not None:
                release_pins(self.cache, pending.state)  # already off the queue, mid-completion
            pending.future.cancel()
        self._notify()  # freed room may unblock a batch

    def close(self, timeout_s: float | None = 30.0) -> None:
        with self._lock:  # the lock submit checks under: no request slips in after the drain
            if self._closed:
                return
            self._closed = True
        with self._wakeup:
            self._wakeup.notify_all()
        self._thread.join(timeout_s)
        with self._lock:
            pending, self._pending = self._pending, {}
        for request_id, entry in pending.items():
            self.scheduler.abort_request(request_id)
            entry.future.set_exception(RuntimeError(f"encoder engine closed before request {request_id!r} finished"))
        if self.shared_store is not None:
            self.shared_store.close()

    def __enter__(self) -> EncoderEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> EncoderEngineStats:
        with self._lock:
            num_held = len(self._held)
        return EncoderEngineStats(self.num_forwards, self.num_encoded_items,
                                  self.scheduler.num_waiting_requests, num_held, self.cache.metrics)

    def _pending_state(self, request_id: str, state: MultimodalEncoderRequestState) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.state = state

    # -- the loop --------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._wakeup:
            self._has_work = True
            self._wakeup.notify()

    def _loop(self, make_model: Callable[[], EncoderModel], threads: ThreadPolicy, built: Future) -> None:
        try:
            threads.apply()  # on this thread: the one that runs every torch op of the encoder
            built.set_result(make_model())
        except BaseException as err:  # noqa: BLE001 - the constructor re-raises it
            built.set_exception(err)
            return
        while True:
            with self._wakeup:
                while not self._has_work and not self._closed:
                    if self.cluster is not None and self.cluster.waiting:  # items another encoder encodes
                        self._wakeup.wait(POLL_S)
                        break
                    self._wakeup.wait()
                if self._closed:
                    return
                self._has_work = False
            self.busy.begin()
            try:
                if self.cluster is not None and self.cluster.waiting:
                    self._poll_cluster()
                batch = self.scheduler.schedule()
                if not batch.is_empty:
                    self._run_batch(batch)
                    self._notify()  # more may wait, and failed entries need a new producer
            finally:
                self.busy.end()

    def _run_batch(self, batch: ScheduledBatch) -> None:
        if self.cluster is not None:
            try:
                split = self.cluster.split(batch)
            except Exception as error:  # noqa: BLE001 - the store's side must not stop the loop
                self._fail_batch(batch, error)
                return
            batch = self._take(split)
            if batch.is_empty:
                return
        self._encode(batch)

    def _poll_cluster(self) -> None:
        """The items another encoder was encoding: settled from the store, or encoded here (their
        claimant's lease ran out), in batches within this engine's budgets."""
        try:
            batch = self._take(self.cluster.poll())
        except Exception:  # noqa: BLE001 - as in _run_batch: they are encoded here instead
            logger.exception("encoder cache store: looking up awaited items failed; encoding them here")
            batch = self.cluster.stop_waiting()
        for part in self.cluster.within_budgets(batch, self.scheduler.budgets):
            self._encode(part)

    def _take(self, split: Split) -> ScheduledBatch:
        """Commit what came from the cluster's store; -> what is left to encode."""
        if not split.found.is_empty:
            self._settle(split.found, lambda: self.runner.commit_outputs(split.found, split.outputs))
        return split.encode

    def _encode(self, batch: ScheduledBatch) -> None:
        self.num_forwards += 1
        self.num_encoded_items += len(batch)
        encoded = self._settle(batch, lambda: self.runner.forward_items(batch))
        if self.cluster is not None and encoded:
            self.cluster.share(batch, self.cache)
        elif self.cluster is not None:
            self.cluster.forget(batch)

    def _settle(self, batch: ScheduledBatch, produce: Callable[[], list]) -> bool:
        """``produce()`` (-> the requests it made ready) and complete them; a failure fails only the
        requests it names. -> whether it succeeded."""
        try:
            ready = produce()
        except (MultimodalEncoderRequestError, MultimodalEncoderInputError) as error:
            self._fail_requests(error.request_ids, error)
            return False
        except Exception as error:  # a bug past the runner's own handling must not kill the loop
            self._fail_batch(batch, error)
            return False
        self._complete(ready)
        return True

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> None:
        """A batch failed past the runner's own handling: its producers' requests fail (logged), and
        the requests that only share its items get a new producer."""
        logger.exception("encoder batch of %d items failed unexpectedly", len(batch))
        wrapped = MultimodalEncoderRequestError(f"encoder batch failed: {error}", request_ids=batch.producer_request_ids)
        for key in batch.cache_keys:
            self.cache.fail(key, wrapped, producer_only=True)
        self._fail_requests(wrapped.request_ids, wrapped)
        if self.cluster is not None:
            self.cluster.forget(batch)

    def _complete(self, states: list[MultimodalEncoderRequestState]) -> None:
        for state in states:
            with self._lock:
                pending = self._pending.pop(state.request_id, None)
                if pending is None:  # completed by the other path, released, or closed
                    continue
                result = EncoderResult(
                    embeddings=[entry.tensor for entry in state.entries],
                    cache_hits=[entry.produced_by != state.request_id for entry in state.entries],
                    ready_events=[entry.ready_event for entry in state.entries])
                if pending.hold_until_release:
                    self._held[state.request_id] = list(state.cache_keys)
            if not pending.hold_until_release:
                release_pins(self.cache, state)
            pending.future.set_result(result)

    def _fail_requests(self, request_ids, error: BaseException) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
            with self._lock:
                pending = self._pending.pop(request_id, None)
            if pending is not None:
                for_request = getattr(error, "for_request", None)
                pending.future.set_exception(for_request(request_id) if for_request else error)


def output_budgets_for(model_dir: str | Path, config: EncoderConfig) -> tuple[int, int]:
    """(C) output and (D) cache bytes an encoder of this checkpoint will hold with ``config``,
    from the checkpoint's files alone (no weights loaded): what an engine sharing its device
    leaves free when it sizes its KV cache (``EngineConfig.reserved_device_bytes``)."""
    from types import SimpleNamespace

    from epd.models.checkpoint import read_config
    from epd.models.registry import family_for

    model_dir = Path(model_dir)
    media = family_for(model_dir).media_settings(model_dir)
    raw = read_config(model_dir)
    text = raw.get("text_config") or {}
    pretrained = SimpleNamespace(hidden_size=raw.get("hidden_size") or text.get("hidden_size"), text_config=None)
    row_bytes = resolve_bytes_per_mm_encoder_embedding(None, pretrained, config.torch_dtype)
    return resolve_output_budgets(config, model_max_atomic_item_tokens=media.max_item_encoder_tokens,
                                  bytes_per_embedding=row_bytes, encoder_tokens_per_row=media.image.merge_size ** 2)


def media_item_from_bytes(data: bytes, media: MediaSettings, *, model_id: str, processor_kwargs: dict | None = None,
                          modality: str = "image") -> EncoderItem:
    """Hashes and geometry of one encoded image or video, from its header (no pixel decoded)."""
    settings = media.with_kwargs(processor_kwargs)
    kwargs = settings.item_kwargs(modality, media)
    if modality == "video":
        geometry = video_geometry_from_bytes(data, settings.video)
    else:
        geometry = image_geometry_from_bytes(data, settings.image)
    return EncoderItem(
        data=bytes(data),
        content_hash=hash_encoded_media(data, modality=modality, processor_kwargs=kwargs, model_id=model_id),
        processor_kwargs_hash=hash_processor_kwargs(kwargs),
        expected_rows=geometry.num_embedding_rows,
        encoder_tokens=geometry.num_patches,
        processor_kwargs=kwargs,
        modality=modality,
    )
