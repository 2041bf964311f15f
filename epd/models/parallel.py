"""Tensor parallelism for the LLM: each of ``size`` ranks holds 1/size of every large matrix and the
ranks meet in one collective per sublayer (Megatron's layout, as vLLM, SGLang and TensorRT-LLM cut
it).

- Column-parallel (``ColumnParallelPacked``: q|k|v, gate|up): each rank holds a slice of every
  packed part's output rows; its outputs are its own heads / its own slice of the MLP, no
  communication.
- Row-parallel (``RowParallelLinear``: o_proj, down_proj): each rank holds the matching input
  columns, computes a partial sum, and one all-reduce adds them.
- Vocab-parallel (``VocabParallelEmbedding``, ``ParallelLMHead``): each rank holds a range of the
  vocabulary's rows; a lookup is masked to the rank's range and all-reduced, logits are gathered on
  rank 0, which samples.
- KV heads are split like the query heads; with fewer KV heads than ranks each KV head is
  replicated on ``size / num_kv_heads`` ranks (the ranks whose query heads read it), because a
  KV head cannot be split below one head.

Weights load already cut: every layer takes the checkpoint's whole tensor as a lazy slice and reads
only its own rows or columns (``load_shard`` / ``load_weight``), so no rank materializes the model.
With ``size == 1`` every layer is the plain one and no collective runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epd.models.layers import PackedLinear


class TensorParallelError(ValueError):
    """A model that cannot be cut into this many ranks (the message names both numbers)."""


@dataclass(frozen=True)
class TensorParallel:
    """Where this process sits: ``rank`` of ``size``, and the process group the collectives use
    (None when ``size == 1``)."""

    rank: int = 0
    size: int = 1
    group: object = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def gather_last_to_first(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` joined on the last dim, in rank order, on rank 0 (which samples);
        the other ranks get their own ``t`` back. Only rank 0 receives: an all-gather of a batch's
        logits ([8, 151,936] floats, 4.9 MB) to every rank cost more than the step's LM head."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(t, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else t

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a CPU tensor: gloo carries it on CUDA too), so
        the ranks agree on a size each measured on its own device (its KV pages)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def split(self, total: int, what: str) -> int:
        """``total`` cut evenly -> this rank's share; one that does not divide is refused."""
        if total % self.size:
            raise TensorParallelError(f"{what} ({total}) does not divide into {self.size} tensor-parallel ranks")
        return total // self.size


SINGLE = TensorParallel()


def check_cuttable(hf_config: dict, size: int) -> None:
    """A checkpoint's LLM (its ``config.json``) cut into ``size`` ranks, or ``TensorParallelError``
    naming the number that does not divide: checked before any rank starts."""
    text = {**hf_config, **hf_config.get("text_config", {})}
    tp = TensorParallel(0, size)
    HeadLayout.of(text["num_attention_heads"], text["num_key_value_heads"], tp)
    tp.split(text["intermediate_size"], "intermediate_size")
    tp.split(text["vocab_size"], "vocab_size")


@dataclass(frozen=True)
class HeadLayout:
    """This rank's attention heads: ``num_heads`` query heads from ``first_head`` and
    ``num_kv_heads`` KV heads from ``first_kv_head`` (one, replicated, when there are fewer KV heads
    than ranks)."""

    num_heads: int
    first_head: int
    num_kv_heads: int
    first_kv_head: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> "HeadLayout":
        local = tp.split(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            local_kv = tp.split(num_kv_heads, "num_key_value_heads")
            return cls(local, tp.rank * local, local_kv, tp.rank * local_kv)
        if tp.size % num_kv_heads:
            raise TensorParallelError(f"num_key_value_heads ({num_kv_heads}) neither divides into nor divides "
                                      f"{tp.size} tensor-parallel ranks")
        # fewer KV heads than ranks: this rank's query heads all read one KV head (the grouping
        # keeps a query head with its own KV head, as the whole model has it)
        return cls(local, tp.rank * local, 1, tp.rank * num_kv_heads // tp.size)


class ColumnParallelPacked(PackedLinear):
    """A ``PackedLinear`` of which this rank holds, for each packed part, ``local_sizes[i]`` output
    rows starting at checkpoint row ``starts[i]`` of that part."""

    def __init__(self, in_features: int, local_sizes: list[int], starts: list[int], bias: bool) -> None:
        super().__init__(in_features, local_sizes, bias=bias)
        self.starts = starts

    def load_shard(self, param_name: str, loaded, shard_id: int) -> None:
        start, size = self.starts[shard_id], self.shard_sizes[shard_id]
        super().load_shard(param_name, _rows(loaded, start, size), shard_id)


class RowParallelLinear(nn.Linear):
    """``in_features`` cut across the ranks (this rank: columns ``[start, start + local)``); the
    partial products are all-reduced. No bias: the Qwen decoders' row-parallel layers have none."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, what: str) -> None:
        local = tp.split(in_features, what)
        super().__init__(local, out_features, bias=False)
        self.tp, self.start = tp, tp.rank * local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def load_weight(self, loaded) -> None:
        _copy(self.weight, _columns(loaded, self.start, self.in_features))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + local)`` of the embedding table; ids outside them look up zeros here
    and get their row from the rank that holds it (one all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        local = tp.split(vocab_size, "vocab_size")
        self.tp, self.start = tp, tp.rank * local
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size  # nn.Embedding's names, for the whole table
        self.weight = nn.Parameter(torch.empty(local, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0.0))

    def load_weight(self, loaded) -> None:
        _copy(self.weight, _rows(loaded, self.start, self.weight.shape[0]))


class ParallelLMHead(nn.Module):
    """The LM head's rows of this rank's vocabulary range; ``forward`` gives rank 0, which samples,
    the whole ``[N, vocab]`` logits (the other ranks: their own columns, which nobody reads)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        local = tp.split(vocab_size, "vocab_size")
        self.tp, self.start = tp, tp.rank * local
        self.weight = nn.Parameter(torch.empty(local, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_last_to_first(F.linear(hidden, self.weight))

    def load_weight(self, loaded) -> None:
        _copy(self.weight, _rows(loaded, self.start, self.weight.shape[0]))


# ---- reading only this rank's part of a checkpoint tensor --------------------------------------
# ``loaded`` is a torch tensor or a safetensors slice (``safe_open(...).get_slice(name)``), which
# reads from the file only the rows or columns indexed

def _shape(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _rows(loaded, start: int, size: int) -> torch.Tensor:
    shape = _shape(loaded)
    if start + size > shape[0]:
        raise ValueError(f"checkpoint tensor {shape} has no rows [{start}, {start + size})")
    return loaded[start:start + size]


def _columns(loaded, start: int, size: int) -> torch.Tensor:
    shape = _shape(loaded)
    if len(shape) != 2 or start + size > shape[1]:
        raise ValueError(f"checkpoint tensor {shape} has no columns [{start}, {start + size})")
    return loaded[:, start:start + size]


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded)
