"""The router's stats line: rates over the interval since the last line, the requests running and
waiting at the router and on each engine tier, decode's KV usage, the tiers' busy share where their
workers count it, what the encoders encoded and the requests moved; nothing while idle."""
from __future__ import annotations

from epd.router.metrics import RouterMetrics
from epd.router.stats_log import StatsLog


class _Pipeline:
    """What StatsLog reads of a RequestPipeline: its metrics and its health view."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics("m")
        self.workers = {
            "encoder": [{"address": "e0", "healthy": True, "running": 0, "waiting": 0, "kv_usage": 0.0, "busy": 0.25}],
            "prefill": [{"address": "p0", "healthy": True, "running": 1, "waiting": 0, "kv_usage": 0.2}],
            "decode": [{"address": "d0", "healthy": True, "running": 3, "waiting": 2, "kv_usage": 0.41, "busy": 1.0},
                       {"address": "d1", "healthy": True, "running": 4, "waiting": 0, "kv_usage": 0.12, "busy": 0.8},
                       {"address": "d2", "healthy": False, "running": 9, "waiting": 9, "kv_usage": 0.99, "busy": 0.0}]}

    def refresh_metrics(self) -> None:
        pass

    def health(self) -> dict:
        return {"workers": self.workers}


def test_a_line_per_interval_with_rates_tiers_kv_encodes_and_moves(monkeypatch):
    clock = iter([100.0, 110.0, 120.0])
    monkeypatch.setattr("epd.router.stats_log.time.monotonic", lambda: next(clock))
    pipeline = _Pipeline()
    stats = StatsLog(pipeline)  # t = 100
    metrics = pipeline.metrics
    metrics.prompt_tokens.inc(350)
    metrics.output_tokens += 4120
    metrics.in_flight.set(8)
    metrics.queue_depth.set(3)
    metrics._encoder_counts = {("encoder", "e0"): (2, 6)}  # what refresh_cluster keeps from the health replies
    metrics.refresh_moves({"migrated": 1, "redispatched": 1})
    metrics.refresh_handoffs({("embeddings", "same_host"): 8, ("embeddings", "cross_host"): 2, ("kv", "same_host"): 5})
    assert stats.line() == ("stats: 35.0 prompt, 412.0 generation tokens/s; requests 8 running, 3 waiting; "
                            "prefill 1 running, 0 waiting; decode 7 running, 2 waiting, KV 41%, busy 90%; encoded 6 of "
                            "10 items (encoder cache hits 40%), encoders busy 25%; moved 2")
    # t = 110; the unhealthy decode is not counted; prefill's worker does not count its busy time
    metrics.in_flight.set(0)
    metrics.queue_depth.set(0)
    assert stats.line() is None  # t = 120: nothing ran, nothing in flight


def test_the_request_log_says_sizes_and_sampling_never_the_text(caplog):
    import asyncio
    import logging

    from epd.models.locate import resolve_model
    from epd.router.backends.in_process import InProcessBackend
    from epd.types import ChatRequest, SamplingParams
    from tests.router.test_pipeline import make_pipeline

    model_dir = resolve_model("null-qwen2-vl")
    secret = "my password is hunter2"

    async def main(enabled: bool) -> None:
        pipeline = make_pipeline(model_dir, InProcessBackend(model_dir), enable_log_requests=enabled)
        await pipeline.start()
        try:
            request = ChatRequest(messages=[{"role": "user", "content": secret}], request_id="r1",
                                  sampling=SamplingParams(max_tokens=5, ignore_eos=True, seed=7))
            async for _ in pipeline.generate(request):
                pass
        finally:
            await pipeline.close()

    with caplog.at_level(logging.INFO, logger="epd.router"):
        asyncio.run(main(False))
        assert not [r for r in caplog.records if "request r1" in r.getMessage()]
        asyncio.run(main(True))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request r1#")]
    assert len(lines) == 2, lines
    assert "prompt tokens, max_tokens=5, temperature=0.0" in lines[0] and "seed=7" in lines[0], lines[0]
    assert "finished (length), 5 tokens, TTFT " in lines[1], lines[1]
    assert not any(secret in r.getMessage() or "hunter2" in r.getMessage() for r in caplog.records)
