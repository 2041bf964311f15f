"""Decode steps replayed from CUDA graphs, one per batch-size bucket (CUDA + FlashInfer).

A pure-decode step is the same few hundred kernel launches every time; on a GPU their launch cost,
not the arithmetic, bounds small and medium batches. Each bucket's forward (embedding, every layer,
the LM head) is captured once at start-up into a graph over static buffers; a step of B decodes
then copies its inputs into the smallest bucket b >= B, plans FlashInfer's decode for the padded
batch (outside the graph: planning is host work) and replays. Padding rows read and write one
scratch page that no sequence owns.

Pointer stability is the discipline that makes this correct: a graph replays the addresses it
captured, so every input lives in a buffer allocated once and refilled in place (``copy_``),
FlashInfer's CUDA-graph wrapper keeps its page-table buffers fixed, and ``run`` checks the buffers'
addresses before every replay (a moved buffer would make the graph read stale memory silently).

The pure parts (buckets, padding the page metadata) need no GPU and are tested on the CPU.
"""
from __future__ import annotations

import numpy as np
import torch

from epd.engine.attention.metadata import AttentionMetadata, HostPageMetadata, metadata_on

MAX_CAPTURED_BATCH = 256


def captures_decode_graphs(device: torch.device, attention_backend: str) -> bool:
    """Where decode steps are captured: CUDA with FlashInfer (its CUDA-graph wrapper keeps the page
    tables at fixed addresses); everywhere else every step runs eager."""
    return device.type == "cuda" and attention_backend == "flashinfer"


def decode_batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (capped at 256), vLLM's steps."""
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    return sorted(set(sizes + ([top] if top not in sizes else [])))


def smallest_bucket(buckets: list[int], batch: int) -> int | None:
    return next((b for b in sorted(buckets) if b >= batch), None)


def graph_page_capacity(bucket: int, num_pages: int, block_size: int, max_model_len: int | None) -> int:
    """Page indices one graph's step can list: every row its own pages (sequences sharing a cached
    prefix each list the shared pages again, so the cache's page count is no bound), a row at most
    ``max_model_len`` tokens' worth and never more than the cache; a padding row lists one."""
    per_row = num_pages if max_model_len is None else min(num_pages, -(-max_model_len // block_size))
    return bucket * max(per_row, 1)


def pad_decode_metadata(host: HostPageMetadata, bucket: int, scratch_page: int,
                        block_size: int) -> HostPageMetadata:
    """A decode-only step of B sequences as ``bucket`` rows: each padding row has one token in the
    scratch page (its own slot written, that slot read), so every kernel sees real-looking rows
    and no sequence's KV is touched."""
    batch = len(host.seq_lens)
    pad = bucket - batch
    if pad < 0 or not np.all(np.diff(host.query_start_loc) == 1):
        raise ValueError(f"pad_decode_metadata takes <= {bucket} one-token decodes, got query lengths "
                         f"{np.diff(host.query_start_loc).tolist()}")
    width = host.block_tables.shape[1]
    tables = np.concatenate([host.block_tables, np.full((pad, width), scratch_page, dtype=np.int32)])
    slots = host.slot_mapping if host.slot_mapping is not None else np.zeros(0, dtype=np.int64)
    return HostPageMetadata(
        query_start_loc=np.arange(bucket + 1, dtype=np.int32),
        seq_lens=np.concatenate([host.seq_lens, np.ones(pad, dtype=np.int32)]),
        block_tables=tables,
        kv_indptr=np.concatenate([host.kv_indptr, host.kv_indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)]),
        kv_indices=np.concatenate([host.kv_indices, np.full(pad, scratch_page, dtype=np.int32)]),
        kv_last_page_len=np.concatenate([host.kv_last_page_len, np.ones(pad, dtype=np.int32)]),
        slot_mapping=np.concatenate([slots, np.full(pad, scratch_page * block_size, dtype=np.int64)]),
    )


class _Graph:
    def __init__(self, bucket: int, device: torch.device, backend) -> None:
        self.bucket, self.backend = bucket, backend
        self.input_ids = torch.zeros(bucket, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, bucket, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(bucket, dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        self.pointers: tuple[int, ...] = ()

    def buffers(self) -> tuple[int, ...]:
        return (self.input_ids.data_ptr(), self.positions.data_ptr(), self.slot_mapping.data_ptr(),
                *self.backend.graph_buffer_pointers())


class DecodeGraphRunner:
    """Owns the captured graphs of one ``ModelRunner`` (which allocates the scratch page)."""

    def __init__(self, runner, batch_sizes: list[int]) -> None:
        from epd.engine.attention.flashinfer import WORKSPACE_BYTES, FlashInferAttentionBackend

        if not captures_decode_graphs(runner.device, runner.attention_backend):
            raise ValueError("decode CUDA graphs need a CUDA engine with attention_backend flashinfer")
        self.runner = runner
        self.scratch_page = runner.num_blocks  # the KV cache has one page past the block manager's
        self.num_pages = runner.num_blocks + 1
        self._graphs: dict[int, _Graph] = {}
        pool = torch.cuda.graph_pool_handle()
        # one split-KV scratch for every graph: one graph replays at a time, each planned just before
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=runner.device)
        for bucket in sorted(batch_sizes, reverse=True):  # largest first: the others fit in its pool
            capacity = graph_page_capacity(bucket, self.num_pages, runner.block_size, runner.max_model_len)
            backend = FlashInferAttentionBackend(runner.backend.spec, graph_batch_size=bucket, max_pages=capacity,
                                                 workspace=workspace)
            self._graphs[bucket] = self._capture(_Graph(bucket, runner.device, backend), pool)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def run(self, step) -> torch.Tensor | None:
        """Logits [B, V] of a pure-decode ``step`` from a graph, or None (run it eager)."""
        meta = step.meta
        if step.mm_rows or meta.num_decodes != meta.num_seqs or len(step.sampling_seqs) != meta.num_seqs:
            return None
        bucket = smallest_bucket(self.buckets, meta.num_seqs)
        if bucket is None:
            return None
        graph = self._graphs[bucket]
        batch = meta.num_seqs
        graph.backend.plan(self._meta(pad_decode_metadata(meta.host, bucket, self.scratch_page, meta.block_size),
                                      graph))
        graph.input_ids[:batch].copy_(step.input_ids)
        graph.input_ids[batch:].zero_()
        graph.positions[:, :batch].copy_(step.positions)
        graph.positions[:, batch:].zero_()
        if graph.buffers() != graph.pointers:
            raise RuntimeError(f"decode graph {bucket}: a static buffer moved since capture; replaying it would "
                               f"read stale memory")
        graph.graph.replay()
        return graph.logits[:batch]

    # ---- capture ------------------------------------------------------------------------
    def _meta(self, host: HostPageMetadata, graph: _Graph) -> AttentionMetadata:
        meta = metadata_on(host, host.slot_mapping, graph.bucket, self.runner.block_size, self.num_pages,
                           self.runner._to_device)
        graph.slot_mapping.copy_(meta.slot_mapping)
        meta.slot_mapping = graph.slot_mapping  # the graph's own buffer, refilled in place
        return meta

    def _forward(self, graph: _Graph, meta: AttentionMetadata) -> torch.Tensor:
        model = self.runner.model
        embeds = model.embed_tokens(graph.input_ids).to(self.runner.dtype)
        hidden = model(embeds, graph.positions, self.runner.kv_cache, meta, graph.backend)
        return model.compute_logits(hidden)

    def _capture(self, graph: _Graph, pool) -> _Graph:
        bucket, bs = graph.bucket, self.runner.block_size
        empty = HostPageMetadata(query_start_loc=np.zeros(1, dtype=np.int32), seq_lens=np.zeros(0, dtype=np.int32),
                                 block_tables=np.zeros((0, 1), dtype=np.int32), kv_indptr=np.zeros(1, dtype=np.int32),
                                 kv_indices=np.zeros(0, dtype=np.int32), kv_last_page_len=np.zeros(0, dtype=np.int32))
        meta = self._meta(pad_decode_metadata(empty, bucket, self.scratch_page, bs), graph)
        graph.backend.plan(meta)
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side), torch.inference_mode():  # warm up: lazy inits happen outside the graph
            for _ in range(2):
                self._forward(graph, meta)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        with torch.inference_mode(), torch.cuda.graph(graph.graph, pool=pool):
            graph.logits = self._forward(graph, meta)
        graph.pointers = graph.buffers()
        return graph
