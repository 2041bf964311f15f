"""The LLM engine: block manager and scheduler (plain Python), model runner, attention backends,
sampler, and the loop thread that owns them (``engine_loop``)."""
