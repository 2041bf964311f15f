"""Paged attention: step metadata, the backend protocol, and the backends (``sdpa``: the reference;
``flex``: flex_attention over the paged cache in place; ``flashinfer``: FlashInfer's paged kernels
on CUDA). Importing this package registers them all; a backend's own library loads only when used."""
from epd.engine.attention import flashinfer, flex, sdpa  # noqa: F401  (register the backends)
from epd.engine.attention.base import ATTENTION_BACKENDS, AUTO, AttentionBackend, AttentionSpec, resolve_backend
from epd.engine.attention.metadata import AttentionMetadata, HostPageMetadata, KVCache, build_page_metadata, metadata_on
from epd.engine.attention.sdpa import SdpaAttentionBackend

__all__ = ["ATTENTION_BACKENDS", "AUTO", "AttentionBackend", "AttentionMetadata", "AttentionSpec", "HostPageMetadata",
           "KVCache", "SdpaAttentionBackend", "build_page_metadata", "metadata_on", "resolve_backend"]
