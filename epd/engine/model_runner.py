"""Turns a scheduled step into tensors, runs the LLM over paged KV, returns logits of the
sequences that sample. Everything index-like (positions, slots, which rows are embeddings) is
built on CPU and shipped once: searching ``input_ids`` on a device would sync with the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from epd.engine.attention import ATTENTION_BACKENDS, AttentionMetadata, KVCache, PrefillSegment
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
    sampling_chunks: list[ScheduledChunk]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 attention_backend: str = "sdpa", mm_token_ids: tuple[int, ...] = ()) -> None:
        cfg = model.config
        # in-vocab placeholders allow the one-lookup fusion path; empty -> OOV-safe path
        self.mm_token_ids = torch.tensor(mm_token_ids, dtype=torch.long) if mm_token_ids else None
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.backend = ATTENTION_BACKENDS.get(attention_backend)()
        self.kv_cache = KVCache.allocate(cfg.num_hidden_layers, num_blocks * block_size,
                                         cfg.num_key_value_heads, cfg.head_dim, dtype, self.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run one step; returns logits [B, V] for the chunks that sample, and those chunks."""
        step = self.prepare(out)
        embeds, _ = fuse_input_embeds(self.model.embed_tokens, step.input_ids, step.mm_rows,
                                      mm_token_ids=self.mm_token_ids, text_token_indices=step.text_token_indices,
                                      mm_token_indices=step.mm_token_indices)
        hidden = self.model(embeds.to(self.dtype), step.positions, self.kv_cache, step.meta, self.backend)
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return logits, step.sampling_chunks

    # ---- KV hand-off between workers ---------------------------------------------------------
    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """-> [num_layers, 2, num_tokens, num_kv_heads, head_dim], a contiguous copy."""
        slots = self._to_device(self._slots(block_table, 0, num_tokens))
        return torch.stack([torch.stack([k[slots], v[slots]])
                            for k, v in zip(self.kv_cache.k, self.kv_cache.v)])

    def check_kv(self, kv: torch.Tensor, num_tokens: int) -> None:
        """Refuse a KV this cache cannot take: another model, dtype or prompt length."""
        expected = (len(self.kv_cache.k), 2, num_tokens, *self.kv_cache.k[0].shape[1:])
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(f"imported KV has shape {tuple(kv.shape)} and dtype {kv.dtype}, expected "
                             f"{expected} and {self.dtype}")

    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        self.check_kv(kv, kv.shape[2])
        slots = self._to_device(self._slots(block_table, 0, kv.shape[2]))
        kv = kv.to(self.device, non_blocking=True)
        for layer, (k, v) in enumerate(zip(self.kv_cache.k, self.kv_cache.v)):
            k.index_copy_(0, slots, kv[layer, 0])
            v.index_copy_(0, slots, kv[layer, 1])

    # ---- input preparation (CPU) -------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        ids, positions, slots, prefills, decodes, logits_idx, sampling = [], [], [], [], [], [], []
        mm_rows, mm_idx = [], []
        cursor = 0
        for chunk in out.chunks:
            seq = chunk.seq
            ids.extend(seq.token_ids[chunk.start:chunk.end])
            positions.append(positions_for_range(seq.mm, chunk.start, chunk.end, seq.num_prompt_tokens))
            if chunk.num_tokens == 1 and chunk.start > 0:  # a decode: its KV is read by block table
                slots.append(self._slot(seq.block_table, chunk.start))
                decodes.append((cursor, seq.block_table, chunk.end))
            else:
                slots.append(self._slots(seq.block_table, chunk.start, chunk.end))
                prefills.append(PrefillSegment(cursor, chunk.num_tokens, self._slots(seq.block_table, 0, chunk.end)))
            rows, local_idx = _chunk_mm_rows(seq.mm, chunk, seq.num_prompt_tokens)
            if rows is not None:
                mm_rows.append(rows)
                mm_idx.append(local_idx + cursor)
            cursor += chunk.num_tokens
            if chunk.samples:
                logits_idx.append(cursor - 1)
                sampling.append(chunk)
        mm_token_indices = torch.cat(mm_idx) if mm_idx else torch.empty(0, dtype=torch.long)
        meta = self._attention_metadata(torch.cat(slots), prefills, decodes)
        return StepInputs(
            input_ids=self._to_device(torch.tensor(ids, dtype=torch.long)),
            positions=self._to_device(torch.cat(positions, dim=1)),
            meta=meta,
            mm_rows=[r.to(self.device, non_blocking=True) for r in mm_rows],
            mm_token_indices=self._to_device(mm_token_indices),
            text_token_indices=self._to_device(_complement(mm_token_indices, cursor)),
            logits_indices=self._to_device(torch.tensor(logits_idx, dtype=torch.long)),
            sampling_chunks=sampling,
        )

    def _slot(self, block_table: list[int], pos: int) -> torch.Tensor:
        return torch.tensor([block_table[pos // self.block_size] * self.block_size + pos % self.block_size])

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _attention_metadata(self, slot_mapping: torch.Tensor, prefills: list[PrefillSegment],
                            decodes: list[tuple[int, list[int], int]]) -> AttentionMetadata:
        """``decodes``: (row in the flat batch, block table, tokens in KV after this step) each; their
        block tables are padded into one tensor and their lengths into one mask, with no per-token
        work on the host."""
        meta = AttentionMetadata(slot_mapping=self._to_device(slot_mapping),
                                 prefills=[PrefillSegment(p.q_start, p.q_len, self._to_device(p.kv_slots))
                                           for p in prefills], block_size=self.block_size)
        if decodes:
            num_blocks = max(-(-kv_len // self.block_size) for _, _, kv_len in decodes)
            tables = torch.tensor([table[:num_blocks] + [0] * (num_blocks - min(num_blocks, len(table)))
                                   for _, table, _ in decodes], dtype=torch.long)
            lengths = torch.tensor([kv_len for _, _, kv_len in decodes], dtype=torch.long)
            mask = torch.arange(num_blocks * self.block_size)[None, :] < lengths[:, None]
            meta.decode_q_indices = self._to_device(torch.tensor([q for q, _, _ in decodes], dtype=torch.long))
            meta.decode_block_tables = self._to_device(tables)
            meta.decode_kv_mask = self._to_device(mask[:, None, None, :])
        return meta

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


def _complement(indices: torch.Tensor, total: int) -> torch.Tensor:
    keep = torch.ones(total, dtype=torch.bool)
    keep[indices] = False
    return keep.nonzero().squeeze(1)
