"""Turns a scheduled step into tensors, runs the LLM over paged KV, returns logits of the
sequences that sample. Everything index-like (positions, slots, which rows are embeddings) is
built on CPU and shipped once: searching ``input_ids`` on a device would sync with the host."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from epd.engine.attention import (
    ATTENTION_BACKENDS,
    AttentionMetadata,
    AttentionSpec,
    KVCache,
    build_page_metadata,
    metadata_on,
    resolve_backend,
)
from epd.engine.block_tables import BlockTableMirror
from epd.engine.decode_graphs import captures_decode_graphs
from epd.engine.mm_inputs import SequenceMultimodal, positions_for_range
from epd.engine.scheduler import ScheduledChunk, SchedulerOutput
from epd.multimodal.fuse import fuse_input_embeds
from epd.multimodal.runtime import MultimodalRuntimeData


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [3, T] int64
    meta: AttentionMetadata
    mm_rows: list[torch.Tensor]  # embedding rows this step needs, in flat-batch order
    mm_token_indices: torch.Tensor  # [sum rows] int64 flat positions the rows go to
    text_token_indices: torch.Tensor  # [T - sum rows] int64
    logits_indices: torch.Tensor  # [B] rows of the flat batch whose logits are sampled
    sampling_seqs: list  # the sequences those rows belong to, in order
    every_row_samples: bool = False  # a decode step: logits of every row, no gather of the hidden states
    # async scheduling: (flat index, sequence) of inputs that are the previous step's tokens, still on
    # the device: ``input_ids`` has 0 there until the engine fills them in (``execute``'s ``fill``)
    pending: list = None


def local_heads(model: torch.nn.Module) -> tuple[int, int]:
    """(query heads, KV heads) this process's part of the model holds: all of them, or a
    tensor-parallel rank's (its ``local_heads``)."""
    cfg = model.config
    return getattr(model, "local_heads", None) or (cfg.num_attention_heads, cfg.num_key_value_heads)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 attention_backend: str = "sdpa", mm_token_ids: tuple[int, ...] = (),
                 decode_graph_sizes: tuple[int, ...] | list[int] = (), max_model_len: int | None = None) -> None:
        """``decode_graph_sizes``: decode batch sizes to capture as CUDA graphs (used on CUDA with
        the flashinfer backend; elsewhere every step runs eager). ``max_model_len``: the longest
        sequence, which bounds the pages a graph's row can list (None: the whole cache)."""
        cfg = model.config
        # in-vocab placeholders allow the one-lookup fusion path; empty -> OOV-safe path
        self.mm_token_ids = torch.tensor(mm_token_ids, dtype=torch.long) if mm_token_ids else None
        self.model = model
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention_backend = resolve_backend(attention_backend, self.device, dtype)
        num_heads, num_kv_heads = local_heads(model)
        self.num_kv_heads_total = cfg.num_key_value_heads  # what a KV hand-off carries, whatever the ranks
        self.backend = ATTENTION_BACKENDS.get(self.attention_backend)(AttentionSpec(
            num_heads, num_kv_heads, cfg.head_dim, dtype, block_size))
        self.block_tables = BlockTableMirror()
        graphs = list(decode_graph_sizes) if captures_decode_graphs(self.device, self.attention_backend) else []
        self.kv_pages = num_blocks + (1 if graphs else 0)  # + the decode graphs' padding page, owned by no sequence
        self.kv_cache = KVCache.allocate(cfg.num_hidden_layers, self.kv_pages * block_size,
                                         num_kv_heads, cfg.head_dim, dtype, self.device)
        self.ranks = None  # rank 0 of a tensor-parallel group: what sends each step to the others
        self.graphs = None
        if graphs:
            from epd.engine.decode_graphs import DecodeGraphRunner
            self.graphs = DecodeGraphRunner(self, graphs)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, fill=None, kept=None) -> tuple[torch.Tensor, list]:
        """Run one step; returns logits [B, V] for the sequences that sample, and those sequences.
        ``fill(step)``: writes the inputs that are still on the device (``StepInputs.pending``);
        ``kept``: decodes kept as rows from step to step, run first."""
        step = self.prepare(out, kept)
        if step.pending:
            if fill is None:
                raise RuntimeError(f"{len(step.pending)} input tokens of this step are not known, and nothing "
                                   "holds them")
            fill(step)
        return self.run(step), step.sampling_seqs

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """A prepared step -> logits [B, V] of the rows that sample."""
        if self.ranks is None:
            return self.forward(step)
        # tensor parallel: the other ranks run the same step with their part
        return self._with_ranks(self._forward_in_ranks, step)

    def _forward_in_ranks(self, step: StepInputs) -> torch.Tensor:
        self.ranks.send_step(step)
        return self.forward(step)

    def _with_ranks(self, work, *args):
        """``work(*args)``, which the other tensor-parallel ranks join: refused once they are out of
        step, and a failure leaves them so (a rank may have died mid-collective)."""
        self.ranks.check()
        try:
            return work(*args)
        except Exception as err:
            self.ranks.fail(err)
            raise

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """The model over one step's inputs -> logits [B, V] of the rows that sample (every
        tensor-parallel rank runs this, each with its part of the model and of the KV cache)."""
        if self.graphs is not None and (logits := self.graphs.run(step)) is not None:
            return logits
        self.backend.plan(step.meta)  # once per step, before the first layer
        main_rows, deepstack = self._split_deepstack(step)
        embeds, _ = fuse_input_embeds(self.model.embed_tokens, step.input_ids, main_rows,
                                      mm_token_ids=self.mm_token_ids, text_token_indices=step.text_token_indices,
                                      mm_token_indices=step.mm_token_indices)
        extra = {"deepstack": deepstack} if deepstack is not None else {}
        hidden = self.model(embeds.to(self.dtype), step.positions, self.kv_cache, step.meta, self.backend, **extra)
        return self.model.compute_logits(hidden if step.every_row_samples else hidden[step.logits_indices])

    def _split_deepstack(self, step: StepInputs) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """A deepstack model's rows are packed ``[main | level 1 | ... | level L]``: the main part is
        fused into the inputs, each level scattered at the same placeholder positions into a
        zero-filled ``[T, hidden]`` (a text position gets nothing added)."""
        levels = getattr(self.model, "deepstack_levels", 0)
        if not levels or not step.mm_rows:
            return step.mm_rows, None
        hidden = self.model.config.hidden_size
        rows = torch.cat(step.mm_rows) if len(step.mm_rows) > 1 else step.mm_rows[0]
        if rows.shape[-1] != hidden * (1 + levels):
            raise ValueError(f"embedding rows are {rows.shape[-1]} wide; this model takes {hidden} x (1 + {levels} "
                             f"deepstack levels) = {hidden * (1 + levels)}")
        num_tokens = step.input_ids.shape[0]
        deepstack = []
        for level in range(1, levels + 1):
            added = torch.zeros(num_tokens, hidden, dtype=self.dtype, device=self.device)
            added.index_copy_(0, step.mm_token_indices, rows[:, level * hidden:(level + 1) * hidden].to(self.dtype))
            deepstack.append(added)
        return [rows[:, :hidden]], deepstack

    # ---- KV hand-off between workers ---------------------------------------------------------
    def read_kv(self, block_table: list[int], num_tokens: int, allocate=None) -> torch.Tensor:
        """-> [num_layers, 2, num_tokens, num_kv_heads, head_dim], every KV head of the model (a
        tensor-parallel engine joins its ranks' heads), a contiguous copy, written once: each
        layer's K and V straight into their place in it. ``allocate(shape, dtype)``: where the copy
        lives (prefill passes its TensorStore's shared memory: the CPU hand-off to decode is then a
        lease on this very memory, not a second copy)."""
        slots = self._slots(block_table, 0, num_tokens)
        k0 = self.kv_cache.k[0]
        shape = (len(self.kv_cache.k), 2, num_tokens, self.num_kv_heads_total, k0.shape[2])
        out = allocate(shape, k0.dtype) if allocate is not None and k0.device.type == "cpu" else \
            torch.empty(shape, dtype=k0.dtype, device=k0.device)
        if self.ranks is None:
            self.read_kv_at(slots, out)
            return out
        self._with_ranks(self._read_kv_in_ranks, slots, out)
        return out

    def _read_kv_in_ranks(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        self.ranks.read_kv(slots, out, self.read_kv_at)  # the ranks read theirs while this one does

    def read_kv_at(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This process's KV heads at ``slots`` -> [num_layers, 2, len(slots), local KV heads, head_dim]."""
        slots = self._to_device(slots)
        k0 = self.kv_cache.k[0]
        if out is None:
            out = torch.empty((len(self.kv_cache.k), 2, len(slots), *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
        for layer, (k, v) in enumerate(zip(self.kv_cache.k, self.kv_cache.v)):
            torch.index_select(k, 0, slots, out=out[layer, 0])
            torch.index_select(v, 0, slots, out=out[layer, 1])
        return out

    def check_kv(self, kv: torch.Tensor, num_tokens: int) -> None:
        """Refuse a KV this cache cannot take: another model, dtype or prompt length."""
        expected = (len(self.kv_cache.k), 2, num_tokens, self.num_kv_heads_total, self.kv_cache.k[0].shape[2])
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(f"imported KV has shape {tuple(kv.shape)} and dtype {kv.dtype}, expected "
                             f"{expected} and {self.dtype}")

    def write_kv(self, block_table: list[int], kv: torch.Tensor, source=None) -> None:
        """An imported KV (every head of the model) into this sequence's pages; a tensor-parallel
        engine hands each rank its own heads (``source``: the handle ``kv`` came from, which the
        ranks may read themselves)."""
        self.check_kv(kv, kv.shape[2])
        slots = self._slots(block_table, 0, kv.shape[2])
        if self.ranks is not None:
            kv = self._with_ranks(self.ranks.write_kv, slots, kv, source)  # -> this rank's heads
        self.write_kv_at(slots, kv)

    def write_kv_at(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """``kv`` [num_layers, 2, len(slots), local KV heads, head_dim]: this process's heads."""
        slots = self._to_device(slots)
        kv = kv.to(self.device, non_blocking=True)
        for layer, (k, v) in enumerate(zip(self.kv_cache.k, self.kv_cache.v)):
            k.index_copy_(0, slots, kv[layer, 0])
            v.index_copy_(0, slots, kv[layer, 1])

    # ---- input preparation (CPU) -------------------------------------------------------------
    @property
    def _page_list(self) -> bool:
        """Whether a step's metadata carries the CSR page list: for a backend that plans from it,
        and for tensor-parallel ranks (their step message carries every field)."""
        return self.backend.reads_page_list or self.ranks is not None

    def prepare(self, out: SchedulerOutput, kept=None) -> StepInputs:
        """The step's inputs, decodes first. Per chunk only what Python must read from the
        sequence (its token ids, its M-RoPE delta, its rows); positions, slots and every piece of
        page metadata come from array operations over the whole batch. ``kept``: decodes kept as
        rows from step to step (``epd.engine.decode_batch``), which come first, the chunks after."""
        if kept is not None and not out.chunks:
            return self.prepare_decodes(kept)
        decodes, others = [], []
        if kept is None:
            for c in out.chunks:
                (decodes if c.num_tokens == 1 else others).append(c)
        else:  # every chunk goes after the rows (a one-token chunk may take the prefill path: any length may)
            others = out.chunks
        chunks, num_decodes = decodes + others, len(decodes)
        first = len(kept.seqs) if kept is not None else 0  # the chunks' place in the step, after the rows
        # one pass over the chunks for what Python must read of each sequence (a pass per field was
        # a visible share of a large decode batch's step)
        seqs, starts, deltas, ids, in_prompt, samples, pending = [], [], [], [], [], [], []
        for n, c in enumerate(chunks, start=first):
            seq = c.seq
            seqs.append(seq)
            starts.append(c.start)
            deltas.append(seq.mm.mrope_delta if seq.mm is not None else 0)
            if c.num_tokens == 1:
                if c.start < len(seq.token_ids):
                    ids.append(seq.token_ids[c.start])
                else:  # sampled by the step before, not known here yet: filled in on the device
                    pending.append((len(ids), seq))
                    ids.append(0)
            else:
                ids.extend(seq.token_ids[c.start:c.end])
            if c.start < seq.num_prompt_tokens:  # only these can need embedding rows or positions of their own
                in_prompt.append(n)
            samples.append(c.samples)
        query_lens = np.ones(len(chunks), dtype=np.int64)
        query_lens[num_decodes:] = [c.num_tokens for c in others]
        if kept is not None:
            self.block_tables.ensure_free(len(seqs))  # the chunks' sequences take no row of the kept ones
        rows = self.block_tables.rows_for(seqs)  # may grow the array: index it after
        starts, deltas = np.array(starts, dtype=np.int64), np.array(deltas, dtype=np.int64)
        ids = torch.tensor(ids, dtype=torch.long)
        if kept is not None:
            starts, deltas = np.concatenate([kept.starts, starts]), np.concatenate([kept.deltas, deltas])
            query_lens, rows = np.concatenate([_ones(first), query_lens]), np.concatenate([kept.rows, rows])
            ids, samples, num_decodes = torch.cat([torch.from_numpy(kept.token_ids), ids]), [True] * first + samples, first
        host, slots = build_page_metadata(self.block_tables.array, starts, query_lens, self.block_size, rows,
                                          page_list=self._page_list)
        meta = metadata_on(host, slots, num_decodes, self.block_size, self.kv_pages, self._to_device)
        positions = self._positions(chunks, first, host, starts, deltas, in_prompt)
        mm_rows, mm_idx = [], []
        for n in in_prompt:
            chunk = chunks[n - first]
            rows, local_idx = _chunk_mm_rows(chunk.seq.mm, chunk, chunk.seq.num_prompt_tokens)
            if rows is not None:
                mm_rows.append(rows)
                mm_idx.append(local_idx + int(host.query_start_loc[n]))
        mm_token_indices = torch.cat(mm_idx) if mm_idx else torch.empty(0, dtype=torch.long)
        samples = np.array(samples, dtype=bool)
        logits_idx = host.query_start_loc[1:][samples].astype(np.int64) - 1
        total = int(host.query_start_loc[-1])
        sampling = [c.seq for c, sampled in zip(chunks, samples[first:].tolist()) if sampled]
        return StepInputs(
            input_ids=self._to_device(ids),
            positions=self._to_device(positions),
            meta=meta,
            mm_rows=[r.to(self.device, non_blocking=True) for r in mm_rows],
            mm_token_indices=self._to_device(mm_token_indices),
            text_token_indices=self._to_device(_complement(mm_token_indices, total)),
            logits_indices=self._to_device(torch.from_numpy(logits_idx)),
            sampling_seqs=kept.seqs + sampling if kept is not None else sampling,
            every_row_samples=len(logits_idx) == total,
            pending=pending,
        )

    def prepare_decodes(self, kept) -> StepInputs:
        """A step of decodes alone from a batch kept from step to step: row ``i`` computes its token
        ``kept.token_ids[i]`` at position ``kept.starts[i]``, its pages in row ``kept.rows[i]`` of the
        block tables, its M-RoPE offset ``kept.deltas[i]``. No Python per sequence."""
        batch = len(kept.starts)
        host, slots = build_page_metadata(self.block_tables.array, kept.starts, _ones(batch), self.block_size,
                                          kept.rows, page_list=self._page_list)
        every_row = torch.arange(batch)
        return StepInputs(
            input_ids=self._to_device(torch.from_numpy(kept.token_ids)),
            positions=self._to_device(torch.from_numpy(kept.starts + kept.deltas).expand(3, -1).clone()),
            meta=metadata_on(host, slots, batch, self.block_size, self.kv_pages, self._to_device),
            mm_rows=[], mm_token_indices=self._to_device(torch.empty(0, dtype=torch.long)),
            text_token_indices=self._to_device(every_row), logits_indices=self._to_device(every_row),
            sampling_seqs=kept.seqs, every_row_samples=True, pending=[])

    def _positions(self, chunks: list[ScheduledChunk], first: int, host, starts: np.ndarray, deltas: np.ndarray,
                   in_prompt: list[int]) -> torch.Tensor:
        """[3, T] int64 M-RoPE positions: ``position + mrope_delta`` for every token, then the
        prompt tokens of multimodal prefill chunks (among ``in_prompt``: their place in the step,
        ``chunks`` starting at ``first``) overwritten by their sequence's own."""
        query_lens = np.diff(host.query_start_loc)
        owner = np.repeat(np.arange(len(starts)), query_lens)
        flat = np.arange(int(host.query_start_loc[-1])) - host.query_start_loc[owner] + starts[owner] + deltas[owner]
        positions = torch.from_numpy(flat).expand(3, -1).clone()
        for n in in_prompt:
            chunk = chunks[n - first]
            mm = chunk.seq.mm
            if mm is not None and mm.mrope_positions is not None:
                row = int(host.query_start_loc[n])
                positions[:, row:row + chunk.num_tokens] = positions_for_range(
                    mm, chunk.start, chunk.end, chunk.seq.num_prompt_tokens)
        return positions

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t


def _chunk_mm_rows(mm: SequenceMultimodal | None, chunk: ScheduledChunk,
                   prompt_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Embedding rows this chunk needs and their chunk-local positions: rows
    ``[cached, cached + in chunk)`` of the sequence, found with two cumsum lookups. A prompt range
    past the cached prefix needs its rows; a sequence that cannot say which (no cumsum) or no
    longer has them (stripped) fails here rather than run with an image missing."""
    if mm is None or chunk.start >= prompt_len:
        return None, None  # text only, or a decode step: positions come from the delta
    if mm.embed_mask_cumsum is None:
        if mm.embeddings is not None:
            raise RuntimeError("sequence has embedding rows but no embed-mask cumsum: it cannot locate its "
                               "embedding rows for a chunk")
        raise RuntimeError("sequence needs embedding rows for a prefill chunk but its multimodal data was "
                           "already stripped")
    runtime = MultimodalRuntimeData(past_seen_token_num=chunk.start, chunk_end_pos=min(chunk.end, prompt_len),
                                    embed_mask_cumsum=mm.embed_mask_cumsum)
    if runtime.num_mm_tokens_in_chunk == 0:
        return None, None
    if mm.embeddings is None:
        raise RuntimeError("sequence needs embedding rows for a prefill chunk but its multimodal data was "
                           "already stripped")
    first = runtime.num_cached_mm_tokens
    last = first + runtime.num_mm_tokens_in_chunk
    # slice before join: one item's rows stay a view, several items copy only the rows needed
    return mm.embeddings.rows(first, last), mm.embed_positions[first:last] - chunk.start


@functools.cache
def _ones(n: int) -> np.ndarray:
    ones = np.ones(n, dtype=np.int64)
    ones.flags.writeable = False  # shared by every step of this size
    return ones


def _complement(indices: torch.Tensor, total: int) -> torch.Tensor:
    if indices.numel() == 0:  # a step without embedding rows (every decode step): all of them
        return torch.arange(total)
    keep = torch.ones(total, dtype=torch.bool)
    keep[indices] = False
    return keep.nonzero().squeeze(1)
