"""``MultimodalEncoderRunner``: runs one scheduled encoder batch.

A *NoKVCache runner*: no KV pool, no sampler; its only job is encoding. ``forward_items``
collects, moves only the inputs the model declares it reads on the device, encodes, validates the
whole batch, then commits it all; a failure never leaves part of a batch published, and a request
whose items are all encoded drops its raw media at once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from epd.encoder.cache import EncoderCacheKey
from epd.encoder.errors import MultimodalEncoderInputError, MultimodalEncoderRequestError
from epd.encoder.item_scheduler import MultimodalEncoderRequestState, MultimodalItemScheduler, ScheduledBatch
from epd.errors import UNDECODABLE_MARKER, InvalidRequest
from epd.multimodal.media import MediaInput
from epd.transport import ready_event_after_writes

# Used when the model declares nothing: the grid stays on CPU, where the vision tower reads it
# with Python loops; on the device every such read would be a device-to-host sync.
DEFAULT_DEVICE_INPUTS = ("pixel_values",)


class EncoderModel(Protocol):
    """What the runner needs of a vision encoder (``QwenVisionEncoder`` is one).

    Optional: ``device_inputs``, the names among ``pixel_values`` and ``grid_thw`` that ``encode``
    reads on the device (default ``DEFAULT_DEVICE_INPUTS``); the others stay on CPU.
    """

    embedding_dim: int
    embedding_dtype: torch.dtype

    def preprocess(self, inputs: list[MediaInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and videos, in order -> pixel patches of all of them and one grid row each."""
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class _OutputTarget:
    """Where one output goes: which request item, which cache key, how many rows."""

    request_id: str
    item_index: int
    cache_key: EncoderCacheKey
    expected_rows: int
    name: str  # the item as its caller names it (errors)


class MultimodalEncoderRunner:
    def __init__(self, model: EncoderModel, scheduler: MultimodalItemScheduler, *, device: str = "cpu",
                 allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
        """``allocate``: where a CPU output is kept (the tier passes its TensorStore's shared memory,
        so the handle that carries the rows to prefill is this very memory: no copy at export)."""
        self.model = model
        self.allocate = allocate
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.device = torch.device(device)
        self.expected_dtype: torch.dtype = model.embedding_dtype
        bytes_per_embedding = scheduler.budgets.bytes_per_embedding
        itemsize = self.expected_dtype.itemsize
        if bytes_per_embedding % itemsize:
            raise ValueError(f"bytes_per_embedding={bytes_per_embedding} is not a multiple of "
                             f"{self.expected_dtype} itemsize {itemsize}")
        self.expected_width = bytes_per_embedding // itemsize
        self.device_inputs = tuple(getattr(model, "device_inputs", None) or DEFAULT_DEVICE_INPUTS)

    def forward_items(self, batch: ScheduledBatch) -> list[MultimodalEncoderRequestState]:
        """Encode ``batch``; -> the requests it made fully ready (their raw payloads stripped).

        Raises ``MultimodalEncoderRequestError`` naming the failed requests: the producers for a
        batch-level error, every request using the key for a wrong output.
        """
        if batch.is_empty:
            return []
        targets = [_OutputTarget(s.request_id, s.item_index, s.cache_key, s.item.expected_rows, s.item.name)
                   for s in batch.items]
        try:
            outputs = self._encode([s.item for s in batch.items])
            if not isinstance(outputs, (list, tuple)) or len(outputs) != len(targets):
                count = len(outputs) if isinstance(outputs, (list, tuple)) else type(outputs).__name__
                raise ValueError(f"encoder returned {count} outputs for {len(targets)} items")
        except Exception as error:
            # one undecodable image must fail only the requests that sent it, as a bad request:
            # find it item by item (only on this path), and the rest go back to be batched again
            if undecodable := self._undecodable(batch):
                raise self._fail_users(batch, undecodable, MultimodalEncoderInputError) from error
            raise self._fail_producers(batch, error) from error
        return self.commit_outputs(batch, outputs)

    def commit_outputs(self, batch: ScheduledBatch, outputs) -> list[MultimodalEncoderRequestState]:
        """Publish one output per scheduled item (encoded here, or fetched from the cluster's
        store): checked, owned, committed to the cache; -> the requests now fully ready."""
        targets = [_OutputTarget(s.request_id, s.item_index, s.cache_key, s.item.expected_rows, s.item.name)
                   for s in batch.items]
        # Validate the entire batch before publishing any output: a bad later item must not
        # leave earlier items READY and their requests sent on to prefill.
        problems = {t.cache_key: msg for t, out in zip(targets, outputs) if (msg := self._check(t, out))}
        if problems:
            raise self._fail_users(batch, problems)
        owned = [_owned(output, self.allocate) for output in outputs]
        ready = ready_event_after_writes(owned[0] if owned else None)  # after the batch's writes, on this stream
        for target, output in zip(targets, owned):
            self.cache.commit(target.cache_key, output, ready)
        ready = self.scheduler.mark_cache_keys_ready(batch.cache_keys)
        for state in ready:
            state.strip_encoder_inputs()
        return ready

    def _preprocess(self, items: list) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.preprocess([MediaInput(item.data, item.modality, item.processor_kwargs) for item in items])

    def _encode(self, items: list) -> list[torch.Tensor]:
        pixel_values, grid_thw = self._preprocess(items)
        inputs = {"pixel_values": pixel_values, "grid_thw": grid_thw}
        for name in self.device_inputs:
            inputs[name] = _to_device(inputs[name], self.device)
        return self.model.encode(inputs["pixel_values"], inputs["grid_thw"])

    def _check(self, target: _OutputTarget, output: object) -> str | None:
        expected_shape = (target.expected_rows, self.expected_width)
        if isinstance(output, torch.Tensor) and tuple(output.shape) == expected_shape \
                and output.dtype == self.expected_dtype:
            return None
        actual = (f"shape {tuple(output.shape)} dtype {output.dtype}" if isinstance(output, torch.Tensor)
                  else f"a {type(output).__name__}")
        return (f"MM item {target.item_index} of request {target.request_id!r} (content hash "
                f"{target.name[:16]}) must produce a {self.expected_dtype} tensor "
                f"with shape {expected_shape}, got {actual}")

    def _fail_producers(self, batch: ScheduledBatch, error: Exception) -> MultimodalEncoderRequestError:
        # A batch-level error cannot be traced to one output, so fail only the scheduled
        # producers. Requests that only share a scheduled entry keep their references, and
        # the next scheduling pass picks a new producer.
        failed = set()
        for key in batch.cache_keys:
            failed |= self.cache.fail(key, error, producer_only=True)
        return MultimodalEncoderRequestError(
            f"encoder batch of {len(batch)} items failed: {type(error).__name__}: {error}",
            request_ids=failed | batch.producer_request_ids)

    def _undecodable(self, batch: ScheduledBatch) -> dict[EncoderCacheKey, str]:
        """The items whose media alone fail to preprocess as a bad input (``InvalidRequest``: not an
        image, truncated, corrupt, too large), by cache key, each with its cause."""
        found = {}
        for s in batch.items:
            try:
                self._preprocess([s.item])
            except InvalidRequest as err:
                found[s.cache_key] = f"{UNDECODABLE_MARKER} {s.item.name}): {err.message}"
            except Exception:  # noqa: BLE001 - not a bad input: the batch-level failure stands
                continue
        return found

    def _fail_users(self, batch: ScheduledBatch, problems: dict[EncoderCacheKey, str],
                    error_type=MultimodalEncoderRequestError):
        # A wrong output (or input) is traced to its key: every request using that key fails, told
        # of its own items only (two users' bad images in one batch must not see each other's). The
        # rest of the batch is published by nobody and goes back to waiting under the same producers.
        by_request: dict[str, list[str]] = {}
        for key, problem in problems.items():
            for request_id in self.cache.fail(key, error_type(problem, request_ids=()), producer_only=False):
                by_request.setdefault(request_id, []).append(problem)
        for key in batch.cache_keys:
            if key not in problems:
                self.cache.requeue(key)
        return error_type("; ".join(problems.values()), request_ids=by_request,
                          messages={rid: "; ".join(found) for rid, found in by_request.items()})


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":  # pinned host memory: a truly async copy
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _owned(output: torch.Tensor, allocate=None) -> torch.Tensor:
    # Per-item outputs are usually views of one merged tensor; caching a view would keep the
    # whole batch's storage alive after its siblings are evicted, breaking the byte budget.
    if allocate is not None and output.device.type == "cpu":  # rows written once, into their handle's memory
        owned = allocate(tuple(output.shape), output.dtype)
        owned.copy_(output)
        return owned
    if not output.is_contiguous() or output.untyped_storage().nbytes() != output.nbytes:
        return output.clone(memory_format=torch.contiguous_format)
    return output
