"""A backend that reads the paged cache in place: ``torch.nn.attention.flex_attention``.

The whole cache of a layer is one key sequence (``[1, KVH, num_blocks * block_size, D]``) and each
query block's block mask lists the pages it reads, so nothing is gathered: the kernel walks the
pages of each sequence straight from the block tables. Decodes go as a batch of one-query rows
(row b reads sequence b's pages; only its last page is partly masked). Prefill chunks go as one
flat row of queries, each chunk padded to whole query blocks so a query block belongs to one
sequence; the mask inside a partial page is causal by position, read from the page's logical index.

Costs to know: flex needs ``torch.compile`` (a few seconds for the first shape a process meets and
once more for the second, after which sizes are dynamic: not a compile per batch size), and its
block mask indexes pages by their physical number, so each query row carries a ``num_blocks``-wide index row (persistent buffers,
``rows x num_blocks`` int32: fine on a CPU-sized cache, large on a 100k-page GPU cache, which is
one reason FlashInfer, not flex, is the CUDA default). GQA runs in the kernel (``enable_gqa``):
no K/V is repeated.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from epd.engine.attention.base import ATTENTION_BACKENDS
from epd.engine.attention.metadata import AttentionMetadata, KVCache

# Past torch.compile's recompile limit dynamo runs a function unfused, and unfused flex applies the
# mask_mods to every key of the cache, ignoring the block lists that keep each query to its own
# sequence's pages: silently wrong attention. A process compiles flex once per new head size, grad
# mode or static-to-dynamic shape, a handful in a server; so the limit is raised well above that,
# and hitting it anyway is an error the request reports instead of wrong tokens. (Exact mask_mods
# would make the unfused path right too, but torch 2.13's CPU flex template fails to compile them.)
_FLEX_RECOMPILE_LIMIT = 64
# On the CPU a prefill's queries go to flex in slabs of this many (padded): one static shape, one
# compile for every prefill. torch 2.13's C++ flex template also fails to build the dynamic-shape
# kernel that a second prefill length compiles, with query rows past its split size (an undeclared
# cur_qSplitSize in the generated code; seen on AVX-512 hosts with 600-token prefills).
_CPU_QUERY_SLAB = 256


@cache
def _compiled_flex():
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _FLEX_RECOMPILE_LIMIT)
    dynamo_config.fail_on_recompile_limit_hit = True

    # dynamic=None (torch's automatic dynamic: the first call compiles static, a second shape
    # recompiles once with dynamic sizes) rather than dynamic=True: on the CPU, torch 2.13's C++
    # flex template fails to compile when the *first* compile is dynamic and a query row is longer
    # than its split size (an undeclared cur_qSplitSize in the generated code, at 290 tokens)
    return torch.compile(flex_attention, dynamic=None)


def kernel_options(device: torch.device, block_size: int) -> dict | None:
    """On CUDA flex runs Triton kernels whose tiles must divide the block mask's blocks (one page
    each); their default tiles (64-128 rows) divide no usual page size, so the tiles are set to 16
    rows and keys, the smallest a Triton matrix product takes. The CPU kernel needs nothing."""
    if device.type != "cuda":
        return None
    if block_size % 16:
        raise ValueError(f"attention_backend flex on CUDA needs a KV block size that is a multiple of 16, got "
                         f"{block_size} (--block-size)")
    return {"BLOCK_M": 16, "BLOCK_N": 16}


@dataclass
class _FlexPlan:
    decode_mask: object | None  # BlockMask over [num_decodes, 1 query] x the cache
    prefill_masks: list  # BlockMasks over [1, one slab of the padded prefill queries] x the cache
    prefill_rows: torch.Tensor | None  # [prefill queries] int64: each query's row in the padded batch
    num_padded: int
    kernel_options: dict | None  # the CUDA kernels' tiles (None on the CPU)


class _IndexRows:
    """Persistent ``[rows, num_blocks]`` int32 page-index rows (grown on demand): a block mask needs
    ``num_blocks`` columns per query block, and only the first few of each row are ever read, so
    they are written in place each step instead of allocated."""

    def __init__(self) -> None:
        self._full = self._partial = None

    def take(self, rows: int, num_blocks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._full is None or self._full.shape[0] < rows or self._full.shape[1] != num_blocks \
                or self._full.device != torch.device(device):
            capacity = max(rows, 2 * (0 if self._full is None else self._full.shape[0]), 16)
            self._full = torch.zeros(capacity, num_blocks, dtype=torch.int32, device=device)
            self._partial = torch.zeros(capacity, num_blocks, dtype=torch.int32, device=device)
        return self._full[:rows], self._partial[:rows]


@ATTENTION_BACKENDS.register("flex")
class FlexAttentionBackend:
    reads_page_list = False

    def __init__(self, spec=None) -> None:
        self.spec = spec
        self._decode_rows, self._prefill_rows = _IndexRows(), _IndexRows()
        self._logical: torch.Tensor | None = None  # [num_blocks] int32: a page's index in its sequence

    def plan(self, meta: AttentionMetadata) -> None:
        options = kernel_options(meta.block_tables.device, meta.block_size)  # refused here, before any layer
        decode_mask = prefill_rows = None
        prefill_masks, num_padded = [], 0
        if meta.num_decodes:
            decode_mask = self._decode_mask(meta)
        if meta.num_decodes < meta.num_seqs:
            prefill_masks, prefill_rows, num_padded = self._prefill_masks(meta)
        meta.plan = _FlexPlan(decode_mask, prefill_masks, prefill_rows, num_padded, options)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv_cache.write(layer_idx, meta.slot_mapping, k, v)
        keys = kv_cache.k[layer_idx].transpose(0, 1).unsqueeze(0)  # [1, KVH, slots, D]: a view, no copy
        values = kv_cache.v[layer_idx].transpose(0, 1).unsqueeze(0)
        flex, plan, nd = _compiled_flex(), meta.plan, meta.num_decodes
        options = plan.kernel_options
        out = torch.empty_like(q)
        if plan.decode_mask is not None:
            out[:nd] = flex(q[:nd].unsqueeze(2), keys, values, block_mask=plan.decode_mask, scale=scale,
                            enable_gqa=True, kernel_options=options).squeeze(2)
        if plan.prefill_masks:
            padded = q.new_zeros(plan.num_padded, q.shape[1], q.shape[2])
            padded[plan.prefill_rows] = q[nd:]
            queries = padded.transpose(0, 1).unsqueeze(0)  # [1, H, padded, D]
            slab = plan.num_padded // len(plan.prefill_masks)
            o = torch.cat([flex(queries[:, :, i * slab:(i + 1) * slab], keys, values, block_mask=mask, scale=scale,
                                enable_gqa=True, kernel_options=options)
                           for i, mask in enumerate(plan.prefill_masks)], dim=2)
            out[nd:] = o[0].transpose(0, 1)[plan.prefill_rows]
        return out

    # ---- block masks ------------------------------------------------------------------------
    def _decode_mask(self, meta: AttentionMetadata):
        from torch.nn.attention.flex_attention import BlockMask

        nd, bs, device = meta.num_decodes, meta.block_size, meta.block_tables.device
        seq_lens = meta.seq_lens[:nd].long()
        pages = (seq_lens + bs - 1) // bs
        last_len = seq_lens - (pages - 1) * bs
        num_full = torch.where(last_len == bs, pages, pages - 1)
        width = int(-(-meta.host.seq_lens[:nd].max() // bs))
        full, partial = self._decode_rows.take(nd, meta.num_blocks, device)
        full[:, :width] = meta.block_tables[:nd, :width]
        partial[:, 0] = meta.block_tables[:nd].gather(1, (pages - 1)[:, None]).squeeze(1)

        def last_page_only(b, h, q_idx, kv_idx):  # the one partial page is the last: its first rows are real
            return kv_idx % bs < last_len[b]
        return BlockMask.from_kv_blocks(
            (pages - num_full).int().view(nd, 1, 1), partial.view(nd, 1, 1, -1), num_full.int().view(nd, 1, 1),
            full.view(nd, 1, 1, -1), BLOCK_SIZE=bs, mask_mod=last_page_only,
            seq_lengths=(1, meta.num_blocks * bs), compute_q_blocks=False)

    def _prefill_masks(self, meta: AttentionMetadata):
        """Query blocks of ``block_size`` queries, each within one chunk: pages wholly at or before
        its first query are read unmasked, the pages its queries end in are masked by position. On
        the CPU in slabs of ``_CPU_QUERY_SLAB`` queries, a mask each (padding blocks read no page);
        on CUDA one slab. -> (the masks, each query's row in the padded batch, padded rows)."""

        host, nd, bs, device = meta.host, meta.num_decodes, meta.block_size, meta.block_tables.device
        query_lens = host.query_lens[nd:].astype(np.int64)
        seq_lens = host.seq_lens[nd:].astype(np.int64)
        tables = host.block_tables[nd:]
        blocks_per_chunk = -(-query_lens // bs)
        chunk_of_block = np.repeat(np.arange(len(query_lens)), blocks_per_chunk)
        first_block = np.concatenate([[0], np.cumsum(blocks_per_chunk)[:-1]])
        local = np.arange(len(chunk_of_block)) - first_block[chunk_of_block]
        first_q = seq_lens[chunk_of_block] - query_lens[chunk_of_block] + local * bs  # position of its first query
        last_q = np.minimum(first_q + bs - 1, seq_lens[chunk_of_block] - 1)
        num_full = (first_q + 1) // bs
        num_partial = last_q // bs + 1 - num_full
        width = tables.shape[1]
        span = int(num_partial.max())
        partial_cols = np.minimum(num_full[:, None] + np.arange(span)[None, :], width - 1)
        partial_pages = np.take_along_axis(tables[chunk_of_block], partial_cols, axis=1)
        real_rows = len(chunk_of_block)
        slab = max(1, _CPU_QUERY_SLAB // bs) if device.type == "cpu" else real_rows  # query blocks a call
        rows = -(-real_rows // slab) * slab
        num_full, num_partial = (np.pad(n, (0, rows - real_rows)) for n in (num_full, num_partial))
        full, partial = self._prefill_rows.take(rows, meta.num_blocks, device)
        full[:real_rows, :width] = torch.from_numpy(tables[chunk_of_block]).to(device)
        partial[:real_rows, :span] = torch.from_numpy(partial_pages).to(device)
        if self._logical is None or self._logical.shape[0] != meta.num_blocks or self._logical.device != device:
            self._logical = torch.zeros(meta.num_blocks, dtype=torch.int32, device=device)
        real = np.arange(span)[None, :] < num_partial[:real_rows, None]  # the partial pages' index in their sequence
        self._logical[torch.from_numpy(partial_pages[real]).long().to(device)] = \
            torch.from_numpy(partial_cols[real].astype(np.int32)).to(device)
        # each real query's row in the padded batch, and every padded row's position (-1: padding)
        query_chunk = np.repeat(np.arange(len(query_lens)), query_lens)
        query_local = np.arange(int(query_lens.sum())) - np.concatenate([[0], np.cumsum(query_lens)[:-1]])[query_chunk]
        padded_rows = first_block[query_chunk] * bs + query_local
        positions = np.full(rows * bs, -1, dtype=np.int32)
        positions[padded_rows] = seq_lens[query_chunk] - query_lens[query_chunk] + query_local
        q_pos = torch.from_numpy(positions).to(device)
        num_partial = torch.from_numpy(num_partial.astype(np.int32)).to(device)
        num_full = torch.from_numpy(num_full.astype(np.int32)).to(device)
        masks = [self._slab_mask(meta, q_pos[i * bs:(i + slab) * bs], num_partial[i:i + slab], partial[i:i + slab],
                                 num_full[i:i + slab], full[i:i + slab]) for i in range(0, rows, slab)]
        return masks, torch.from_numpy(padded_rows).to(device), rows * bs

    def _slab_mask(self, meta: AttentionMetadata, q_pos, num_partial, partial, num_full, full):
        """One slab's mask: its query blocks' page lists, its queries' positions (-1: padding)."""
        from torch.nn.attention.flex_attention import BlockMask

        bs, logical, rows = meta.block_size, self._logical, len(num_partial)

        def causal_by_position(b, h, q_idx, kv_idx):
            return logical[kv_idx // bs] * bs + kv_idx % bs <= q_pos[q_idx]
        return BlockMask.from_kv_blocks(
            num_partial.view(1, 1, rows), partial.reshape(1, 1, rows, -1), num_full.view(1, 1, rows),
            full.reshape(1, 1, rows, -1), BLOCK_SIZE=(bs, bs), mask_mod=causal_by_position,
            seq_lengths=(rows * bs, meta.num_blocks * bs), compute_q_blocks=False)
