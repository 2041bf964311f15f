"""``MultimodalItemScheduler``: forms encoder batches of atomic items under four budgets.

Item scheduling bounds four MM encoder resources, owned in different places and measured in
different units, so they are resolved once, together, in ``create()``:

* (A) ``encoder_batch_size``      -- items per batch (atomic MM items, not attention sequences);
* (B) ``encoder_max_num_tokens``  -- encoder attention tokens per batch, raised to the largest
  atomic item so that item stays schedulable;
* (C) ``output_budget_bytes``     -- output bytes of one legal encoder iteration: the
  scheduler's per-batch limit, and the admission limit for one request;
* (D) ``encoder_cache_max_bytes`` -- makes the same ``TensorLRUCache`` larger than (C); it is
  not a second pool.

(A)-(C) decide whether an item joins this batch (else it waits, FIFO); (C) also rejects a
request that could never fit; (D) triggers LRU eviction. Plain Python: tensors are opaque.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd.encoder.cache import CacheEntry, CacheEntryState, EncoderCacheKey, TensorLRUCache
from epd.encoder.errors import MultimodalEncoderAdmissionError

if TYPE_CHECKING:
    from epd.config import EncoderConfig

logger = logging.getLogger(__name__)

_ITEM_FIELDS = ("data", "content_hash", "processor_kwargs_hash", "expected_rows", "encoder_tokens")


@dataclass(frozen=True)
class EncoderItem:
    """One image or video to encode: encoded bytes plus the metadata the router computed from its
    header."""

    data: bytes = field(repr=False)
    content_hash: str  # the cache key's content part: computed from ``data`` by whoever trusts it
    processor_kwargs_hash: str
    expected_rows: int  # output embedding rows (= placeholder span)
    encoder_tokens: int  # encoder attention tokens (pre-merge patches)
    label: str = ""  # how the caller names the item in errors (its own content hash); default content_hash
    # the image processor kwargs to preprocess with (None: the checkpoint's); part of the cache key
    # through processor_kwargs_hash
    processor_kwargs: Mapping[str, Any] | None = None
    modality: str = "image"  # or "video": one atomic item of several frames

    @property
    def name(self) -> str:
        return self.label or self.content_hash

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray, memoryview)) or not len(self.data):
            raise ValueError(f"EncoderItem.data must be non-empty encoded media bytes, got {type(self.data).__name__}")
        for name in ("content_hash", "processor_kwargs_hash"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"EncoderItem.{name} must be a non-empty str, got {getattr(self, name)!r}")
        for name in ("expected_rows", "encoder_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EncoderItem.{name} must be a positive int, got {value!r}")

    @classmethod
    def coerce(cls, item: object) -> EncoderItem:
        """Accept an ``EncoderItem``, a mapping, or any object with the five fields."""
        if isinstance(item, cls):
            return item
        get = item.get if isinstance(item, Mapping) else (lambda name: getattr(item, name, None))
        missing = [name for name in _ITEM_FIELDS if get(name) is None]
        if missing:
            raise ValueError(f"encoder item lacks {missing}; expected fields {list(_ITEM_FIELDS)}")
        return cls(**{name: get(name) for name in _ITEM_FIELDS})


@dataclass(frozen=True)
class EncoderBudgets:
    encoder_batch_size: int  # (A) items
    configured_encoder_max_num_tokens: int
    encoder_max_num_tokens: int  # (B) effective: max(configured, model_max_atomic_item_tokens)
    model_max_atomic_item_tokens: int
    bytes_per_embedding: int  # one output row
    output_budget_bytes: int  # (C)
    encoder_cache_max_bytes: int  # (D) >= (C)


@dataclass
class MultimodalEncoderRequestState:
    """A request's items, their cache keys and pinned entries, and which are ready."""

    request_id: str
    items: list[EncoderItem | None]  # None once stripped: the request no longer needs its media
    cache_keys: list[EncoderCacheKey]
    entries: list[CacheEntry]
    ready: list[bool]

    @property
    def is_ready(self) -> bool:
        return all(self.ready)

    def pending_item_indices(self) -> list[int]:
        return [i for i, is_ready in enumerate(self.ready) if not is_ready]

    def mark_cache_keys_ready(self, keys: set[EncoderCacheKey]) -> None:
        for i, key in enumerate(self.cache_keys):
            if key in keys and self.entries[i].state is CacheEntryState.READY:
                self.ready[i] = True

    def strip_encoder_inputs(self) -> None:
        """Every item is encoded: its raw media are dead weight while the request waits to be
        exported and released, so drop them (only pending items are ever read)."""
        self.items = [None] * len(self.items)


@dataclass(frozen=True)
class ScheduledItem:
    request_id: str  # the producer
    item_index: int  # position in the request
    cache_key: EncoderCacheKey
    item: EncoderItem


@dataclass(frozen=True)
class ScheduledBatch:
    items: tuple[ScheduledItem, ...] = ()
    num_encoder_tokens: int = 0
    output_bytes: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.items

    @property
    def producer_request_ids(self) -> frozenset[str]:
        return frozenset(s.request_id for s in self.items)

    @property
    def cache_keys(self) -> list[EncoderCacheKey]:
        return [s.cache_key for s in self.items]

    def __len__(self) -> int:
        return len(self.items)


def resolve_output_budgets(config: EncoderConfig, *, model_max_atomic_item_tokens: int, bytes_per_embedding: int,
                           encoder_tokens_per_row: int = 1) -> tuple[int, int]:
    """-> (C) ``output_budget_bytes`` and (D) ``encoder_cache_max_bytes`` as the encoder will use
    them: what the KV sizing of an engine sharing the encoder's GPU must leave free."""
    from epd.multimodal.budget import resolve_mm_encoder_token_budget

    if bytes_per_embedding <= 0 or encoder_tokens_per_row <= 0:
        raise ValueError(f"bytes_per_embedding={bytes_per_embedding} and encoder_tokens_per_row="
                         f"{encoder_tokens_per_row} must be positive")
    effective = resolve_mm_encoder_token_budget(config.encoder_max_num_tokens, model_max_atomic_item_tokens)
    if config.output_budget_bytes is not None:
        output_budget_bytes = config.output_budget_bytes
    else:
        max_rows = config.max_output_rows or effective // encoder_tokens_per_row
        output_budget_bytes = max_rows * bytes_per_embedding
    cache_bytes = config.encoder_cache_max_bytes or output_budget_bytes
    if cache_bytes < output_budget_bytes:
        raise ValueError(
            f"encoder_cache_max_bytes (D)={cache_bytes} must be >= output_budget_bytes (C)="
            f"{output_budget_bytes}: the cache holds one iteration's outputs; it is the same pool")
    largest_item_bytes = model_max_atomic_item_tokens // encoder_tokens_per_row * bytes_per_embedding
    if largest_item_bytes > output_budget_bytes:
        logger.warning("output_budget_bytes=%d is below the largest legal item's %d output bytes; "
                       "such items will be rejected", output_budget_bytes, largest_item_bytes)
    return output_budget_bytes, cache_bytes


class MultimodalItemScheduler:
    def __init__(self, budgets: EncoderBudgets, cache: TensorLRUCache, *, model_id: str) -> None:
        if cache.capacity_bytes < budgets.output_budget_bytes:
            raise ValueError(
                f"cache capacity {cache.capacity_bytes} bytes is below output_budget_bytes (C)="
                f"{budgets.output_budget_bytes}: one encoder iteration's outputs must fit in the cache")
        self.budgets = budgets
        self.cache = cache
        self.model_id = model_id
        self._lock = threading.RLock()
        self._requests: dict[str, MultimodalEncoderRequestState] = {}  # FIFO by arrival

    @classmethod
    def create(
        cls,
        config: EncoderConfig,
        *,
        model_id: str,
        model_max_atomic_item_tokens: int,
        bytes_per_embedding: int,
        encoder_tokens_per_row: int = 1,
    ) -> MultimodalItemScheduler:
        """Resolve (A)-(D) in one place and build the scheduler over a fresh cache.

        ``encoder_tokens_per_row``: attention tokens per output row (Qwen: merge_size**2); it
        turns (B) into the rows one legal iteration can produce, the default for (C).
        """
        # budget.py imports torch at module level; this module stays torch-free on import
        from epd.multimodal.budget import log_encoder_token_budget, resolve_mm_encoder_token_budget

        configured = config.encoder_max_num_tokens
        effective = resolve_mm_encoder_token_budget(configured, model_max_atomic_item_tokens)
        log_encoder_token_budget(configured, effective, model_max_atomic_item_tokens, logger)
        output_budget_bytes, cache_bytes = resolve_output_budgets(
            config, model_max_atomic_item_tokens=model_max_atomic_item_tokens,
            bytes_per_embedding=bytes_per_embedding, encoder_tokens_per_row=encoder_tokens_per_row)
        budgets = EncoderBudgets(
            encoder_batch_size=config.encoder_batch_size,
            configured_encoder_max_num_tokens=configured,
            encoder_max_num_tokens=effective,
            model_max_atomic_item_tokens=model_max_atomic_item_tokens,
            bytes_per_embedding=bytes_per_embedding,
            output_budget_bytes=output_budget_bytes,
            encoder_cache_max_bytes=cache_bytes,
        )
        return cls(budgets, TensorLRUCache(cache_bytes), model_id=model_id)

    # -- admission -------------------------------------------------------------------------
    def add_request(self, request_id: str, items: Sequence[EncoderItem]) -> MultimodalEncoderRequestState:
        """Admit a request and look its items up; a fully cached one comes back ready, unqueued.

        Raises ``MultimodalEncoderAdmissionError`` at once for a request that can never fit.
        """
        items = [EncoderItem.coerce(item) for item in items]
        self._check_admissible(request_id, items)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already queued on this encoder")
            keys = [self.cache_key(item) for item in items]
            entries = [self.cache.lookup_or_reserve(key, request_id, self._item_bytes(item))[0]
                       for key, item in zip(keys, items)]
            state = MultimodalEncoderRequestState(request_id, items, keys, entries, ready=[False] * len(items))
            state.mark_cache_keys_ready(set(keys))
            if state.is_ready:  # every item was cached: nothing will read its media
                state.strip_encoder_inputs()
            else:
                self._requests[request_id] = state
            return state

    def cache_key(self, item: EncoderItem) -> EncoderCacheKey:
        return EncoderCacheKey(item.content_hash, item.processor_kwargs_hash, self.model_id, item.expected_rows)

    def _item_bytes(self, item: EncoderItem) -> int:
        return item.expected_rows * self.budgets.bytes_per_embedding

    def _check_admissible(self, request_id: str, items: list[EncoderItem]) -> None:
        b = self.budgets
        if not items:
            raise MultimodalEncoderAdmissionError(f"request {request_id!r} has no items to encode")
        for index, item in enumerate(items):
            if item.encoder_tokens > b.encoder_max_num_tokens:
                raise MultimodalEncoderAdmissionError(
                    f"request {request_id!r} item {index} needs {item.encoder_tokens} encoder tokens, over "
                    f"encoder_max_num_tokens={b.encoder_max_num_tokens} (B, effective; model_atomic_max="
                    f"{b.model_max_atomic_item_tokens}): larger than any item this model accepts")
            if self._item_bytes(item) > b.output_budget_bytes:
                raise MultimodalEncoderAdmissionError(
                    f"request {request_id!r} item {index} produces {self._item_bytes(item)} output bytes "
                    f"({item.expected_rows} rows x {b.bytes_per_embedding} bytes), over "
                    f"output_budget_bytes={b.output_budget_bytes} (C: one encoder iteration's output)")
        total = sum(self._item_bytes(item) for item in items)
        if total > b.output_budget_bytes:
            raise MultimodalEncoderAdmissionError(
                f"request {request_id!r} produces {total} output bytes over {len(items)} items "
                f"({sum(i.expected_rows for i in items)} rows x {b.bytes_per_embedding} bytes), over "
                f"output_budget_bytes={b.output_budget_bytes} (C: one encoder iteration's output)")

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick waiting items FIFO across requests under (A), (B), (C); never split an item.

        Items another request produces, or that are already in flight, are skipped (this
        request is a consumer). The first producible item that does not fit ends the pass, so
        a large item is never overtaken forever by smaller ones behind it.
        """
        b = self.budgets
        picked: list[ScheduledItem] = []
        keys_in_batch: set[EncoderCacheKey] = set()
        tokens = out_bytes = 0
        with self._lock:
            for state in self._requests.values():
                for index in state.pending_item_indices():
                    key, entry, item = state.cache_keys[index], state.entries[index], state.items[index]
                    if not self._is_producible_by(entry, state.request_id) or key in keys_in_batch:
                        continue
                    if (len(picked) == b.encoder_batch_size
                            or tokens + item.encoder_tokens > b.encoder_max_num_tokens
                            or out_bytes + entry.nbytes > b.output_budget_bytes
                            or not self.cache.begin_produce(key, state.request_id)):
                        return ScheduledBatch(tuple(picked), tokens, out_bytes)
                    picked.append(ScheduledItem(state.request_id, index, key, item))
                    keys_in_batch.add(key)
                    tokens += item.encoder_tokens
                    out_bytes += entry.nbytes
        return ScheduledBatch(tuple(picked), tokens, out_bytes)

    @staticmethod
    def _is_producible_by(entry: CacheEntry, request_id: str) -> bool:
        return (entry.state is CacheEntryState.PENDING and not entry.is_in_flight
                and entry.producer_request_id in (None, request_id))

    def mark_cache_keys_ready(self, keys: Iterable[EncoderCacheKey]) -> list[MultimodalEncoderRequestState]:
        """After a commit: -> the requests now fully ready, taken off the queue."""
        keys = set(keys)
        done = []
        with self._lock:
            for state in list(self._requests.values()):
                state.mark_cache_keys_ready(keys)
                if state.is_ready:
                    done.append(self._requests.pop(state.request_id))
        return done

    def abort_request(self, request_id: str) -> MultimodalEncoderRequestState | None:
        """Take a waiting request off the queue and drop its pins (a consumer may take over)."""
        with self._lock:
            state = self._requests.pop(request_id, None)
        if state is not None:
            release_pins(self.cache, state)
        return state

    def get_request(self, request_id: str) -> MultimodalEncoderRequestState | None:
        with self._lock:
            return self._requests.get(request_id)

    @property
    def num_waiting_requests(self) -> int:
        with self._lock:
            return len(self._requests)


def release_pins(cache: TensorLRUCache, state: MultimodalEncoderRequestState) -> None:
    """One unpin per item, matching the one pin per item taken by ``add_request``."""
    for key in state.cache_keys:
        cache.unpin(key, state.request_id)
