"""FlashInfer's paged kernels on CUDA (the ``gpu`` extra: ``pip install 'epd[gpu]'``).

The cache layers are FlashInfer's NHD pages as they are (``[num_slots, KVH, D]`` viewed as
``[num_blocks, block_size, KVH, D]``: no copy). Each step is planned once: the decodes at the front
of the batch with the decode wrapper (tensor cores, any GQA group), the prefill chunks with the
prefill wrapper, causal and aligned to the end of each sequence's KV (a chunk's query i sees
positions up to ``kv_len - q_len + i``, the same rule as the SDPA reference). Page counts and
query offsets go to ``plan`` from the host (FlashInfer schedules on the CPU from them; a device
copy would be read back); the page indices stay on the device.
"""
from __future__ import annotations

import torch

from epd.engine.attention.base import ATTENTION_BACKENDS, FLASHINFER_DTYPES, AttentionSpec
from epd.engine.attention.metadata import AttentionMetadata, KVCache

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's split-KV scratch; what vLLM gives it


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as err:
        raise RuntimeError(f"attention_backend flashinfer needs FlashInfer ({err}); pip install 'epd[gpu]', or use "
                           f"attention_backend sdpa or flex") from None
    return flashinfer


@ATTENTION_BACKENDS.register("flashinfer")
class FlashInferAttentionBackend:
    reads_page_list = True

    def __init__(self, spec: AttentionSpec, *, graph_batch_size: int | None = None, max_pages: int = 0,
                 workspace: torch.Tensor | None = None) -> None:
        """``graph_batch_size``: a decode-only backend for one captured CUDA graph of that many rows
        (FlashInfer's CUDA-graph wrapper, whose page-table buffers stay at fixed addresses;
        ``max_pages`` sizes the indices buffer). ``workspace``: a scratch shared with other
        backends that never run at the same time (default: its own)."""
        self.spec = spec
        self._workspace = workspace
        self._flashinfer = import_flashinfer()
        if spec.dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"attention_backend flashinfer runs float16 / bfloat16 models, this one is {spec.dtype} "
                             f"(use --dtype bfloat16, or attention_backend sdpa or flex)")
        self.graph_batch_size, self.max_pages = graph_batch_size, max_pages
        self._decode = self._prefill = None
        self._graph_buffers: tuple[torch.Tensor, ...] = ()
        self._has_decodes = self._has_prefills = False

    def _wrappers(self, device: torch.device):
        if self._decode is None:
            workspace = self._workspace if self._workspace is not None else \
                torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            if self.graph_batch_size is None:
                self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                                   use_tensor_cores=True)
                self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            else:
                b = self.graph_batch_size
                self._graph_buffers = (torch.zeros(b + 1, dtype=torch.int32, device=device),
                                       torch.zeros(self.max_pages, dtype=torch.int32, device=device),
                                       torch.ones(b, dtype=torch.int32, device=device))
                indptr, indices, last = self._graph_buffers
                self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
                    paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        return self._decode, self._prefill

    def graph_buffer_pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self._graph_buffers)

    def plan(self, meta: AttentionMetadata) -> None:
        device = meta.block_tables.device
        if device.type != "cuda":
            raise RuntimeError(f"attention_backend flashinfer runs on CUDA; this engine runs on {device} (use sdpa or "
                               f"flex)")
        decode, prefill = self._wrappers(device)
        host, nd, spec = meta.host, meta.num_decodes, self.spec
        shapes = dict(num_qo_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, page_size=spec.block_size)
        dtypes = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=spec.scale)
        split = int(host.kv_indptr[nd])  # the decodes' pages come first
        self._has_decodes, self._has_prefills = nd > 0, nd < meta.num_seqs
        if self._has_prefills and prefill is None:
            raise ValueError(f"a decode-graph backend ({self.graph_batch_size} rows) was planned with prefill chunks")
        if self._has_decodes:
            decode.plan(torch.from_numpy(host.kv_indptr[:nd + 1]), meta.kv_indices[:split],
                        torch.from_numpy(host.kv_last_page_len[:nd]), head_dim=spec.head_dim,
                        pos_encoding_mode="NONE", **shapes, **dtypes)
        if self._has_prefills:
            prefill.plan(torch.from_numpy(host.query_start_loc[nd:] - host.query_start_loc[nd]),
                         torch.from_numpy(host.kv_indptr[nd:] - split), meta.kv_indices[split:],
                         torch.from_numpy(host.kv_last_page_len[nd:]), head_dim_qk=spec.head_dim, causal=True,
                         **shapes, **dtypes)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if abs(scale - self.spec.scale) > 1e-12:
            raise ValueError(f"flashinfer was planned for scale {self.spec.scale}, the layer asks {scale}")
        kv_cache.write(layer_idx, meta.slot_mapping, k, v)
        pages = (kv_cache.k[layer_idx].view(-1, meta.block_size, *k.shape[1:]),
                 kv_cache.v[layer_idx].view(-1, meta.block_size, *k.shape[1:]))
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if self._has_decodes:
            out[:nd] = self._decode.run(q[:nd], pages)
        if self._has_prefills:
            out[nd:] = self._prefill.run(q[nd:], pages)
        return out
