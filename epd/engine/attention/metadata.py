"""One step's attention inputs: where the new tokens' K/V go and which pages each sequence reads.

KV lives in per-layer slot arrays ``[num_blocks * block_size, num_kv_heads, head_dim]``; a token's
slot is ``block_table[pos // block_size] * block_size + pos % block_size``. Viewed as
``[num_blocks, block_size, KVH, D]`` that is a paged cache in the NHD layout paged kernels
(FlashInfer, flex_attention's block masks) read in place.

The flat batch holds the decodes first (one query each), then the prefill chunks, so every backend
can take the decodes as one slice. The page metadata is int32 and comes twice: as a padded block
table (one row per sequence) and in the CSR form paged kernels plan from (``kv_indptr``,
``kv_indices``, ``kv_last_page_len``). ``build_page_metadata`` makes all of it with array
operations over the whole batch: no Python per sequence or per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int  # the first num_decodes sequences have one query each (rows 0..num_decodes-1)
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence s's queries are rows [qsl[s], qsl[s + 1])
    seq_lens: torch.Tensor  # [S] int32: tokens in KV after this step (the new ones included)
    block_tables: torch.Tensor  # [S, max_pages] int32, padded with page 0
    kv_indptr: torch.Tensor  # [S + 1] int32: sequence s's pages are kv_indices[indptr[s]:indptr[s + 1]]
    kv_indices: torch.Tensor | None  # [total pages] int32; None where nothing reads it (see build_page_metadata)
    kv_last_page_len: torch.Tensor  # [S] int32, 1..block_size
    block_size: int  # slots per page
    num_blocks: int  # pages in the cache
    # the same on the host: planning needs Python ints and must not read them back from a GPU
    host: "HostPageMetadata | None" = None
    plan: Any = None  # what the backend's ``plan`` made of this step (its own type)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class HostPageMetadata:
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, max_pages]
    kv_indptr: np.ndarray
    kv_indices: np.ndarray | None
    kv_last_page_len: np.ndarray
    slot_mapping: np.ndarray | None = None  # int64 [T]: each new token's slot

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


def build_page_metadata(block_tables: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                        block_size: int, rows: np.ndarray | None = None, *, page_list: bool = True
                        ) -> tuple[HostPageMetadata, np.ndarray]:
    """Sequence s computes tokens ``[starts[s], starts[s] + query_lens[s])`` and has its pages in
    ``block_tables[rows[s]]`` (``block_tables[s]`` without ``rows``; at least as many as it needs,
    columns past that are ignored). -> (the page metadata, the int64 slot of every new token in
    flat-batch order). Only the columns the step uses are copied: a table is as wide as the longest
    sequence the engine admits (2,048 columns at 32k tokens), a step's as its longest sequence.
    ``page_list``: also the CSR list of every sequence's pages (``kv_indices``), which only paged
    kernels plan from; without it ``kv_indices`` is None (a boolean gather over the whole table,
    the costliest part of a large decode batch's metadata)."""
    starts = np.asarray(starts, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = starts + query_lens
    pages = -(-seq_lens // block_size)
    width = int(pages.max(initial=1))
    picked = block_tables[:, :width] if rows is None else block_tables[rows, :width]
    tables = np.ascontiguousarray(picked, dtype=np.int32)
    query_start_loc = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    # row-major: sequence by sequence
    kv_indices = tables[np.arange(width)[None, :] < pages[:, None]] if page_list else None
    owner = np.repeat(np.arange(len(seq_lens)), query_lens)  # the sequence of each new token
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[owner] + starts[owner]
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    host = HostPageMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens.astype(np.int32), block_tables=tables,
                            kv_indptr=kv_indptr, kv_indices=kv_indices,
                            kv_last_page_len=(seq_lens - (pages - 1) * block_size).astype(np.int32),
                            slot_mapping=slots)
    return host, slots


def metadata_on(host: HostPageMetadata, slots: np.ndarray, num_decodes: int, block_size: int, num_blocks: int,
                to_device) -> AttentionMetadata:
    """The step's metadata with its tensors moved by ``to_device`` (host tensor -> device tensor)."""
    def t(array: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(array)))
    return AttentionMetadata(
        slot_mapping=t(slots), num_decodes=num_decodes, query_start_loc=t(host.query_start_loc),
        seq_lens=t(host.seq_lens), block_tables=t(host.block_tables), kv_indptr=t(host.kv_indptr),
        kv_indices=t(host.kv_indices) if host.kv_indices is not None else None,
        kv_last_page_len=t(host.kv_last_page_len), block_size=block_size, num_blocks=num_blocks, host=host)


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer: [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        shape = (num_slots, num_kv_heads, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    @property
    def bytes_per_slot(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t.shape[1] * t.shape[2] * t.element_size()

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new tokens' K/V into their slots (every backend does this first)."""
        self.k[layer_idx].index_copy_(0, slot_mapping, k)
        self.v[layer_idx].index_copy_(0, slot_mapping, v)
