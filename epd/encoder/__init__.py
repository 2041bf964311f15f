"""The encoder tier: raw media bytes in, per-item embedding rows out (DESIGN §1 item 2).

``config`` → ``item_scheduler`` (four budgets, seed §4) + ``cache`` (read-through byte LRU,
§5.2/§5.4) → ``runner`` (``forward_items``, §5.3) → ``engine`` (thread + futures).
``graph_runner`` captures the vision block loop as CUDA graphs (§8).

Kept import-free on purpose: the scheduler and cache are plain Python and must not pull torch.
"""
