"""The encoder tier: raw media bytes in, per-item embedding rows out.

``item_scheduler`` (batches under four budgets, ``epd.config.EncoderConfig``) + ``cache``
(read-through byte-budget LRU, one producer per item) → ``runner`` (``forward_items``: validate
the whole batch, then commit) → ``engine`` (its thread and futures) → ``servicer`` (gRPC: export
rows as handles, push them to prefill). ``graph_runner`` captures the vision block loop as CUDA graphs.

Kept import-free on purpose: the scheduler and cache are plain Python and must not pull torch.
"""
