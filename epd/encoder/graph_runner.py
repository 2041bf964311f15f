"""CUDA graphs of the vision encoder's block loop, in 2-D buckets.

The runner is intentionally narrow: it does not know the model, how to build attention
metadata, or the eager prelude (patch embedding, positions). It owns the captured block loop,
the static buffers that loop reads, and the map from real workload sizes to captured keys.
Constructing one is the enable signal; every configured bucket is captured at startup and the
set is fixed for the runner's lifetime. Workloads no bucket fits run eager (``maybe_run`` -> None).

Pure parts (bucket order, smallest fit, padding arithmetic) live in ``EncoderGraphBuckets`` and
need no GPU.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch


class EncoderGraphKey(NamedTuple):
    """An encoder graph workload size.

    As a configured bucket: the real (post-prelude) tokens and real contexts it covers, no
    padding. As a captured key: the padded sizes the captured kernels see. Field order is
    (total_tokens, num_contexts) so ``sorted()`` gives the smallest-fit search order.
    """

    total_tokens: int
    num_contexts: int


# Single token kept aside for the dummy padding context. The attention backend rejects
# zero-length contexts, so the dummy must hold at least one token even when the workload exactly
# fills the bucket's real-token budget. Used in buffer sizing (padded_key_for_bucket) and in
# per-replay lengths (padded_seq_lengths, dummy_padded_seq_lengths).
_PADDING_TOKEN_RESERVE: int = 1


@dataclass(frozen=True)
class EncoderGraphTensorSpec:
    """A static input buffer. ``shape`` lists the non-token dims only; the token-axis size comes
    from the bucket and is inserted at ``token_dim``: a ragged ``(total_tokens, hidden)`` input is
    ``EncoderGraphTensorSpec(shape=(hidden,), dtype=..., token_dim=0)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    token_dim: int = 0

    def full_shape(self, total_tokens: int) -> tuple[int, ...]:
        return (*self.shape[:self.token_dim], total_tokens, *self.shape[self.token_dim:])


class EncoderMetadataProvider(Protocol):
    """Builds and refills the attention metadata the block loop reads.

    ``graph_critical_attrs`` names the tensors on the metadata whose addresses the captured
    kernels bake in; ``prepare`` must refill them in place (``copy_``), never reassign them.
    """

    graph_critical_attrs: tuple[str, ...]

    def create(self, key: EncoderGraphKey, device: torch.device) -> Any: ...
    def prepare(self, metadata: Any, seq_lengths: Sequence[int]) -> None: ...


@dataclass
class CuSeqlensMetadata:
    cu_seqlens: torch.Tensor  # int32 [num_contexts + 1], offsets of each context on the token axis
    seq_lens: torch.Tensor  # int32 [num_contexts]


class CuSeqlensMetadataProvider:
    """Varlen attention metadata: per-context lengths and their prefix sums."""

    graph_critical_attrs = ("cu_seqlens", "seq_lens")

    def create(self, key: EncoderGraphKey, device: torch.device) -> CuSeqlensMetadata:
        return CuSeqlensMetadata(
            cu_seqlens=torch.zeros(key.num_contexts + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(key.num_contexts, dtype=torch.int32, device=device))

    def prepare(self, metadata: CuSeqlensMetadata, seq_lengths: Sequence[int]) -> None:
        lengths = torch.tensor(list(seq_lengths), dtype=torch.int32)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=cu[1:])
        metadata.seq_lens.copy_(lengths)
        metadata.cu_seqlens.copy_(cu)


class EncoderGraphBuckets:
    """Configured buckets, smallest-fit selection and padding arithmetic (plain arithmetic).

    With padding, a padded key holds the real contexts plus ``key - bucket`` extra contexts,
    every one of at least one token; so a workload of S tokens in n contexts fits a bucket when
    S <= total_tokens, n <= num_contexts and the padding has a token for every extra context.
    Without padding a workload must match a bucket exactly.
    """

    def __init__(self, buckets: Iterable[tuple[int, int]], *, enable_padding: bool = True) -> None:
        keys = sorted({EncoderGraphKey(*bucket) for bucket in buckets})
        if not keys:
            raise ValueError("need at least one (total_tokens, num_contexts) bucket")
        for key in keys:
            if min(key) <= 0 or key.total_tokens < key.num_contexts:
                raise ValueError(f"bucket {tuple(key)}: need 0 < num_contexts <= total_tokens")
        self.buckets: list[EncoderGraphKey] = keys
        self.enable_padding = enable_padding

    def padded_key_for_bucket(self, bucket: EncoderGraphKey) -> EncoderGraphKey:
        if not self.enable_padding:
            return bucket
        return EncoderGraphKey(bucket.total_tokens + _PADDING_TOKEN_RESERVE, bucket.num_contexts + 1)

    def fits(self, bucket: EncoderGraphKey, total_tokens: int, num_contexts: int) -> bool:
        if not self.enable_padding:
            return bucket == (total_tokens, num_contexts)
        padded = self.padded_key_for_bucket(bucket)
        return (total_tokens <= bucket.total_tokens and num_contexts <= bucket.num_contexts
                and padded.total_tokens - total_tokens >= padded.num_contexts - num_contexts)

    def select_bucket(self, total_tokens: int, num_contexts: int) -> EncoderGraphKey | None:
        """The smallest configured bucket that fits, or None (run eager)."""
        return next((b for b in self.buckets if self.fits(b, total_tokens, num_contexts)), None)

    def padded_seq_lengths(self, seq_lengths: Sequence[int], bucket: EncoderGraphKey) -> list[int]:
        """Real context lengths followed by the dummy contexts that fill the padded key."""
        lengths = [int(n) for n in seq_lengths]
        if any(n <= 0 for n in lengths):
            raise ValueError(f"context lengths must be positive, got {lengths}")
        if not self.fits(bucket, sum(lengths), len(lengths)):
            raise ValueError(f"{len(lengths)} contexts of {sum(lengths)} tokens do not fit bucket {tuple(bucket)}")
        padded = self.padded_key_for_bucket(bucket)
        num_dummies = padded.num_contexts - len(lengths)
        pad_tokens = padded.total_tokens - sum(lengths)
        if num_dummies == 0:
            return lengths
        # the first dummy takes the slack; the rest hold one token each (no zero-length contexts)
        return lengths + [pad_tokens - (num_dummies - 1)] + [1] * (num_dummies - 1)

    def dummy_padded_seq_lengths(self, bucket: EncoderGraphKey) -> list[int]:
        """Lengths for capture: the whole padded key as dummy contexts."""
        padded = self.padded_key_for_bucket(bucket)
        if not self.enable_padding:
            base, extra = divmod(padded.total_tokens, padded.num_contexts)
            return [base + 1] * extra + [base] * (padded.num_contexts - extra)
        return self.padded_seq_lengths([], bucket)


class _CapturedGraph(NamedTuple):
    graph: Any  # torch.cuda.CUDAGraph
    key: EncoderGraphKey  # padded: the sizes the captured kernels see
    inputs: dict[str, torch.Tensor]  # static buffers, token axis = key.total_tokens
    metadata: Any
    # data_ptr() of each provider-declared graph-critical tensor after capture. The captured
    # kernels bake these addresses in, so a reallocation would silently read stale memory.
    metadata_tensor_ptrs: Mapping[str, int]
    # the captured outputs; views returned by maybe_run alias this memory
    outputs: dict[str, torch.Tensor]


EncoderFn = Callable[[Mapping[str, torch.Tensor], Any], Mapping[str, torch.Tensor]]


class MultimodalEncoderGraphRunner:
    """Captures ``encoder_fn(inputs, metadata) -> {name: tensor}`` (the block loop) per bucket.

    ``output_specs`` gives each output's token axis; outputs are not materialized by the runner
    but aliased from ``encoder_fn``'s captured return, and sliced back to the real token count.
    They stay valid until the next ``maybe_run`` (all graphs share one memory pool): clone to keep.
    """

    def __init__(self, encoder_fn: EncoderFn, *, buckets: Iterable[tuple[int, int]],
                 input_specs: Mapping[str, EncoderGraphTensorSpec], output_specs: Mapping[str, int],
                 metadata_provider: EncoderMetadataProvider, device: str | torch.device = "cuda",
                 enable_padding: bool = True, num_warmup_iters: int = 2) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"MultimodalEncoderGraphRunner needs a CUDA device, got {self.device} "
                               f"(cuda available: {torch.cuda.is_available()}); run the encoder eager instead")
        self._encoder_fn = encoder_fn
        self._input_specs = dict(input_specs)
        self._output_specs = dict(output_specs)
        self._metadata_provider = metadata_provider
        self._plan = EncoderGraphBuckets(buckets, enable_padding=enable_padding)
        self._num_warmup_iters = num_warmup_iters
        self._pool = None
        self._graphs: dict[EncoderGraphKey, _CapturedGraph] = {}
        # largest first, so smaller graphs reuse the memory pool the largest one reserved
        for bucket in reversed(self._plan.buckets):
            self._graphs[bucket] = self._capture(bucket)

    @property
    def buckets(self) -> list[EncoderGraphKey]:
        return list(self._plan.buckets)

    @property
    def captured_keys(self) -> list[EncoderGraphKey]:
        return sorted(graph.key for graph in self._graphs.values())

    def select_bucket(self, total_tokens: int, num_contexts: int) -> EncoderGraphKey | None:
        """The bucket a workload would replay, or None (it runs eager)."""
        return self._plan.select_bucket(total_tokens, num_contexts)

    def maybe_run(self, inputs: Mapping[str, torch.Tensor], seq_lengths: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """Replay the smallest fitting graph; -> outputs sliced to the real tokens, or None (run eager)."""
        num_tokens = sum(seq_lengths)
        bucket = self._plan.select_bucket(num_tokens, len(seq_lengths))
        if bucket is None:
            return None
        captured = self._graphs[bucket]
        self._load_inputs(captured, inputs, num_tokens)
        self._metadata_provider.prepare(captured.metadata, self._plan.padded_seq_lengths(seq_lengths, bucket))
        _assert_metadata_buffers_stable(captured.metadata, captured.metadata_tensor_ptrs, captured.key)
        captured.graph.replay()
        return {name: _slice_token_axis(out, self._output_specs[name], num_tokens)
                for name, out in captured.outputs.items()}

    def _capture(self, bucket: EncoderGraphKey) -> _CapturedGraph:
        key = self._plan.padded_key_for_bucket(bucket)
        inputs = {name: torch.zeros(spec.full_shape(key.total_tokens), dtype=spec.dtype, device=self.device)
                  for name, spec in self._input_specs.items()}
        metadata = self._metadata_provider.create(key, self.device)
        self._metadata_provider.prepare(metadata, self._plan.dummy_padded_seq_lengths(bucket))
        with torch.no_grad(), torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up lazily-initialized kernels off the capture
                for _ in range(self._num_warmup_iters):
                    self._encoder_fn(inputs, metadata)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = dict(self._encoder_fn(inputs, metadata))
        if self._pool is None:
            self._pool = graph.pool()
        if set(outputs) != set(self._output_specs):
            raise ValueError(f"encoder_fn returned outputs {sorted(outputs)}, output_specs declares "
                             f"{sorted(self._output_specs)}")
        ptrs = _snapshot_metadata_tensor_ptrs(metadata, self._metadata_provider.graph_critical_attrs)
        return _CapturedGraph(graph, key, inputs, metadata, ptrs, outputs)

    def _load_inputs(self, captured: _CapturedGraph, inputs: Mapping[str, torch.Tensor], num_tokens: int) -> None:
        if set(inputs) != set(self._input_specs):
            raise ValueError(f"inputs {sorted(inputs)} do not match input_specs {sorted(self._input_specs)}")
        for name, spec in self._input_specs.items():
            src, dst = inputs[name], captured.inputs[name]
            if tuple(src.shape) != spec.full_shape(num_tokens) or src.dtype != spec.dtype:
                raise ValueError(f"input {name!r}: expected {spec.dtype} {spec.full_shape(num_tokens)}, "
                                 f"got {src.dtype} {tuple(src.shape)}")
            dst.narrow(spec.token_dim, 0, num_tokens).copy_(src)
            # padding rows feed only the dummy contexts; zero them so stale data never matters
            dst.narrow(spec.token_dim, num_tokens, dst.shape[spec.token_dim] - num_tokens).zero_()


def _slice_token_axis(tensor: torch.Tensor, token_dim: int, num_tokens: int) -> torch.Tensor:
    """A view of the first ``num_tokens`` along ``token_dim``; no copy."""
    return tensor.narrow(token_dim, 0, num_tokens)


def _snapshot_metadata_tensor_ptrs(metadata: Any, attrs: Iterable[str]) -> dict[str, int]:
    ptrs = {}
    for attr in attrs:
        tensor = getattr(metadata, attr, None)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"graph-critical metadata attribute {attr!r} is not a tensor: {type(tensor).__name__}")
        ptrs[attr] = tensor.data_ptr()
    return ptrs


def _assert_metadata_buffers_stable(metadata: Any, snapshot: Mapping[str, int], key: EncoderGraphKey) -> None:
    # A real check, not `assert`: under python -O a moved buffer must still stop the replay.
    for attr, ptr in snapshot.items():
        tensor = getattr(metadata, attr, None)
        now = tensor.data_ptr() if isinstance(tensor, torch.Tensor) else None
        if now != ptr:
            moved = f"moved from {ptr:#x} to {now:#x}" if now is not None else "is no longer a tensor"
            raise RuntimeError(
                f"CUDA graph {tuple(key)}: metadata.{attr} {moved}; the captured kernels would read "
                "stale memory. Refill graph-critical buffers in place (copy_), never reassign them.")
