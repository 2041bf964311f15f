"""Pure logic of ``epd bench``: workload generation, percentiles, goodput, Prometheus parsing, the
SSE driver against canned responses, and the report writers."""
from __future__ import annotations

import asyncio
import io
import json
import math

import httpx
import numpy as np
import pytest
from PIL import Image

from epd.bench.client import OpenAIDriver, RequestRecord, normalize_base_url
from epd.bench.metrics import (
    distribution_ms,
    meets_slo,
    metric_sum,
    parse_prometheus,
    percentile,
    queue_snapshot,
    server_summary,
    summarize,
)
from epd.bench.report import format_sweep, format_table, write_json
from epd.bench.runner import Progress
from epd.bench.workload import (
    WORDS,
    ImageSize,
    ImageSpec,
    RequestSpec,
    WorkloadConfig,
    arrival_intervals,
    arrival_times,
    build_workload,
    choose_images,
    make_prompt,
    parse_image_sizes,
    parse_rates,
    render_image,
    render_images,
)

# ---- workload ------------------------------------------------------------------------------------


def test_parse_image_sizes_and_rates():
    assert parse_image_sizes("448x448") == [ImageSize(448, 448, 1.0)]
    assert parse_image_sizes("224x224:3, 896X672:1") == [ImageSize(224, 224, 3.0), ImageSize(896, 672, 1.0)]
    for bad in ("448", "0x10", "10x10:0", "axb", "10x10:-1", ""):
        with pytest.raises(ValueError):
            parse_image_sizes(bad)
    assert parse_rates("inf") == [math.inf]
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)


@pytest.mark.parametrize("rate,burstiness", [(10.0, 1.0), (4.0, 0.25), (50.0, 4.0)])
def test_arrivals_have_the_gamma_mean_and_spread(rate, burstiness):
    gaps = arrival_intervals(20000, rate, burstiness, np.random.default_rng(7))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson (k=1) has CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    assert (gaps >= 0).all()


def test_poisson_arrivals_count_per_window_is_poisson():
    times = arrival_times(20000, 20.0, 1.0, np.random.default_rng(3))
    counts = np.bincount(times.astype(int))[:-1]  # requests per 1 s window, last (partial) one dropped
    assert counts.mean() == pytest.approx(20.0, rel=0.05)
    assert counts.var() == pytest.approx(20.0, rel=0.25)  # Poisson: variance == mean


def test_arrivals_are_seeded_and_inf_means_at_once():
    a = arrival_times(50, 3.0, 1.0, np.random.default_rng(1))
    b = arrival_times(50, 3.0, 1.0, np.random.default_rng(1))
    assert np.array_equal(a, b) and a[0] == 0 and (np.diff(a) >= 0).all()
    assert not np.array_equal(a, arrival_times(50, 3.0, 1.0, np.random.default_rng(2)))
    assert (arrival_times(10, math.inf, 1.0, np.random.default_rng(1)) == 0).all()
    with pytest.raises(ValueError):
        arrival_intervals(3, 1.0, 0.0, np.random.default_rng(1))


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.8, 1.0])
def test_repeat_ratio(ratio):
    images = choose_images(4000, 1, [ImageSize(64, 64)], ratio, np.random.default_rng(5))
    flat = [im for req in images for im in req]
    repeated = sum(im.repeated for im in flat)
    # the first image can never be a repeat
    assert repeated / (len(flat) - 1) == pytest.approx(ratio, abs=0.03)
    keys = [im.key for im in flat]
    assert len(set(keys)) == len(flat) - repeated  # every repeat re-sends an earlier image, every new one is new
    first_seen = {}
    for i, im in enumerate(flat):
        if im.repeated:
            assert im.key in first_seen and first_seen[im.key] < i
        else:
            first_seen[im.key] = i


def test_image_sizes_follow_weights():
    sizes = [ImageSize(32, 32, 3.0), ImageSize(64, 48, 1.0)]
    images = choose_images(4000, 1, sizes, 0.0, np.random.default_rng(9))
    share = sum(req[0].width == 32 for req in images) / len(images)
    assert share == pytest.approx(0.75, abs=0.03)


def test_rendered_images_are_deterministic_pngs_of_the_right_size():
    for kind in ("gradient", "noise"):
        spec = ImageSpec(40, 30, seed=11, kind=kind)
        data = render_image(spec)
        assert data == render_image(spec)
        assert data != render_image(ImageSpec(40, 30, seed=12, kind=kind))
        with Image.open(io.BytesIO(data)) as im:
            assert im.format == "PNG" and im.size == (40, 30) and im.mode == "RGB"


def test_prompts_have_about_the_requested_number_of_words():
    text = make_prompt(200, np.random.default_rng(0))
    words = text.split()
    assert len(words) == 200 and set(words) <= set(WORDS)


def test_build_workload_is_seeded_and_runs_differ():
    cfg = WorkloadConfig(num_prompts=30, input_len=16, output_len=5, images_per_request=2,
                         image_sizes=(ImageSize(16, 16),), repeat_ratio=0.5, seed=4)
    a, b = build_workload(cfg, 5.0, 1.0), build_workload(cfg, 5.0, 1.0)
    assert [(r.prompt, r.images, r.arrival_s) for r in a] == [(r.prompt, r.images, r.arrival_s) for r in b]
    other = build_workload(cfg, 5.0, 1.0, run_index=1)  # the next rate of a sweep: fresh prompts and images
    assert {im.key for r in a for im in r.images}.isdisjoint({im.key for r in other for im in r.images})
    assert all(len(r.images) == 2 and r.output_len == 5 for r in a)
    render_images(a)
    assert all(len(r.image_inputs) == 2 for r in a)
    assert a[0].arrival_s == 0 and a[-1].arrival_s > 0
    with pytest.raises(ValueError):
        WorkloadConfig(repeat_ratio=1.5)


# ---- percentiles, goodput -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n):
    values = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_in_ms():
    d = distribution_ms([0.001, 0.002, None, 0.003])
    assert d["count"] == 3 and d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0)
    assert d["max"] == pytest.approx(3.0)
    assert distribution_ms([])["p99"] is None


def _record(i, ttft, e2e, tokens, status="ok"):
    r = RequestRecord(index=i, rate=1.0, scheduled_s=float(i), num_images=1)
    r.status, r.ttft_s, r.e2e_s, r.output_tokens, r.start_s = status, ttft, e2e, tokens, float(i)
    return r


def test_tpot_goodput_and_attainment():
    records = [
        _record(0, 0.100, 0.100 + 9 * 0.010, 10),  # TTFT 100, TPOT 10: good
        _record(1, 0.300, 0.300 + 9 * 0.010, 10),  # TTFT over
        _record(2, 0.100, 0.100 + 9 * 0.050, 10),  # TPOT over
        _record(3, 0.050, 0.050, 1),               # one token: TPOT 0, good
        _record(4, None, None, 0, status="failed"),
    ]
    assert records[0].tpot_s == pytest.approx(0.010) and records[3].tpot_s == 0.0 and records[4].tpot_s is None
    assert [meets_slo(r, 200, 20) for r in records] == [True, False, False, True, False]
    assert [meets_slo(r, 200, None) for r in records] == [True, False, True, True, False]
    s = summarize(records, 2.0, slo_ttft_ms=200, slo_tpot_ms=20)
    assert (s["completed"], s["failed"], s["good_requests"]) == (4, 1, 2)
    assert s["goodput"] == pytest.approx(1.0) and s["slo_attainment_pct"] == pytest.approx(40.0)
    assert s["request_throughput"] == pytest.approx(2.0) and s["output_throughput"] == pytest.approx(31 / 2)
    assert s["tpot_ms"]["count"] == 3  # the one-token output has no TPOT sample
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    no_slo = summarize(records, 2.0)
    assert no_slo["goodput"] is None and no_slo["slo_attainment_pct"] is None


# ---- Prometheus ---------------------------------------------------------------------------------

PROM_BEFORE = """# HELP epd_requests_total Requests finished, by outcome
# TYPE epd_requests_total counter
epd_requests_total{outcome="ok"} 5.0
epd_requests_created{outcome="ok"} 1.7e9
epd_ttft_seconds_bucket{le="0.1"} 2.0
epd_ttft_seconds_bucket{le="+Inf"} 5.0
epd_ttft_seconds_sum 1.0
epd_ttft_seconds_count 5.0
epd_router_queue_depth 0.0
# TYPE epd_encoder_encoded_items counter
epd_encoder_encoded_items_total{tier="encoder",worker="127.0.0.1:1"} 10.0
epd_encoder_encoded_items_total{tier="encoder",worker="127.0.0.1:2"} 4.0
epd_worker_queue_depth{tier="encoder",worker="127.0.0.1:1"} 0.0
epd_worker_queue_depth{tier="prefill",worker="127.0.0.1:5"} 1.0
# TYPE epd_prompt_tokens counter
epd_prompt_tokens_total 100.0
# TYPE epd_prompt_cached_tokens counter
epd_prompt_cached_tokens_total 10.0
weird_metric{msg="a \\"quoted\\" \\\\ value, with comma",x="y"} NaN 1700000000
"""

PROM_AFTER = PROM_BEFORE.replace('outcome="ok"} 5.0', 'outcome="ok"} 25.0').replace(
    "epd_ttft_seconds_sum 1.0", "epd_ttft_seconds_sum 3.0").replace(
    "epd_ttft_seconds_count 5.0", "epd_ttft_seconds_count 25.0").replace(
    'worker="127.0.0.1:1"} 10.0', 'worker="127.0.0.1:1"} 22.0').replace(
    "epd_prompt_tokens_total 100.0", "epd_prompt_tokens_total 300.0").replace(
    "epd_prompt_cached_tokens_total 10.0", "epd_prompt_cached_tokens_total 60.0").replace(
    'tier="prefill",worker="127.0.0.1:5"} 1.0', 'tier="prefill",worker="127.0.0.1:5"} 3.0')


def test_parse_prometheus():
    p = parse_prometheus(PROM_BEFORE)
    assert p["epd_requests_total"] == {(("outcome", "ok"),): 5.0}
    assert p["epd_ttft_seconds_bucket"][(("le", "+Inf"),)] == 5.0
    assert metric_sum(p, "epd_encoder_encoded_items_total") == 14.0
    assert metric_sum(p, "epd_encoder_encoded_items_total", worker="127.0.0.1:2") == 4.0
    assert metric_sum(p, "nope") is None
    (labels, value), = p["weird_metric"].items()
    assert dict(labels) == {"msg": 'a "quoted" \\ value, with comma', "x": "y"} and math.isnan(value)
    assert queue_snapshot(p) == {"router_queue": 0.0, "encoder_queue": 0.0, "prefill_queue": 1.0}


class _MetricsEndpoint:
    """A /metrics server on 127.0.0.1 (HTTP/1.1, keep-alive) that counts the connections it took
    and how many of them are still open."""

    def __init__(self) -> None:
        self.accepted = 0
        self.open = 0
        self.server = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/metrics"

    async def _serve(self, reader, writer) -> None:
        self.accepted += 1
        self.open += 1
        try:
            while (await reader.readuntil(b"\r\n\r\n")):
                body = PROM_BEFORE.encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
                             + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def test_the_metrics_sampler_scrapes_through_one_client_and_parses_after_the_streams(monkeypatch):
    """A client per scrape rebuilt its TLS context each time (~30 ms of CPU on the loop that
    timestamps the streams, once a second); one client keeps one connection for the whole run.
    What the scrapes during the run brought is parsed once no stream is read any more."""
    import epd.bench.metrics as metrics
    from epd.bench.runner import run_once

    in_flight, parsed_while = [0], []

    class Driver:  # each request takes a while, so the sampler scrapes several times meanwhile
        async def send(self, spec, record, t0):
            in_flight[0] += 1
            await asyncio.sleep(0.12)
            in_flight[0] -= 1
            record.status = "ok"

    def parse(text):
        parsed_while.append(in_flight[0])
        return parse_prometheus(text)
    monkeypatch.setattr(metrics, "parse_prometheus", parse)
    MetricsSampler = metrics.MetricsSampler

    async def main():
        endpoint = _MetricsEndpoint()
        url = await endpoint.start()
        try:
            sampler = MetricsSampler([url], interval_s=0.03)
            requests = [RequestSpec(i, "hi", [], 4, 0.1 * i, []) for i in range(3)]
            result = await run_once(Driver(), requests, rate=10.0, sampler=sampler, progress=False)
            for _ in range(50):  # the server sees the client's close a moment later
                if endpoint.open == 0:
                    break
                await asyncio.sleep(0.01)
            return endpoint, sampler, result
        finally:
            await endpoint.close()

    endpoint, sampler, result = asyncio.run(main())
    assert len(sampler.samples) >= 5 and not sampler.errors  # before, during (each 30 ms) and after
    assert result.metrics_before is not None and result.metrics_after is not None
    # one connection, and a second where the run's end cancelled a scrape in flight (its connection
    # is dropped); a client per scrape takes one each
    assert endpoint.accepted <= 2, f"{endpoint.accepted} connections for {len(sampler.samples) + 2} scrapes"
    assert endpoint.open == 0  # closed with the run
    assert len(parsed_while) == len(sampler.samples) + 2 and not any(parsed_while)


def test_server_summary_deltas():
    before, after = parse_prometheus(PROM_BEFORE), parse_prometheus(PROM_AFTER)
    samples = [{"t_s": 1.0, "queues": {"prefill_queue": 4.0}}, {"t_s": 2.0, "queues": {"prefill_queue": 2.0}}]
    s = server_summary(before, after, samples, images_sent=20)
    assert s["requests_by_outcome"] == {"ok": 20.0}
    assert s["encoder_encoded_items"] == 12.0
    assert s["encoder_cache_hit_rate"] == pytest.approx(0.4) and s["encoder_cache_hit_rate_source"] == "router"
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert s["server_ttft_mean_ms"] == pytest.approx(100.0)
    q = s["queues"]["prefill_queue"]
    assert (q["before"], q["after"], q["delta"], q["mean"], q["max"]) == (1.0, 3.0, 2.0, 3.0, 4.0)
    # the workers' own cache counters win when they were scraped too
    with_hits = parse_prometheus(PROM_AFTER + "# TYPE epd_encoder_cache_hits counter\nepd_encoder_cache_hits_total 30\n"
                                 "# TYPE epd_encoder_cache_misses counter\nepd_encoder_cache_misses_total 10\n")
    s2 = server_summary(before, with_hits, images_sent=20)
    assert s2["encoder_cache_hit_rate"] == pytest.approx(0.75) and s2["encoder_cache_hit_rate_source"] == "worker"
    assert server_summary(None, None) == {"available": False}


# ---- the SSE driver against canned answers ------------------------------------------------------


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _drive(handler, spec=None):
    spec = spec or RequestSpec(index=0, prompt="hello there", images=[], output_len=3, arrival_s=0.0)

    async def go():
        driver = OpenAIDriver("http://test/v1", model="m", transport=httpx.MockTransport(handler))
        record = RequestRecord(index=0, rate=1.0, scheduled_s=0.0)
        try:
            await driver.send(spec, record, run_t0=0.0)
        finally:
            await driver.aclose()
        return record

    return asyncio.run(go())


def test_driver_counts_tokens_from_chunks_and_usage():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"], seen["body"] = str(request.url), json.loads(request.content)
        body = _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                    {"choices": [{"delta": {"content": "a"}}]},               # no token_ids: one token
                    {"choices": [{"delta": {"content": "bc"}, "token_ids": [5, 6]}]},
                    {"choices": [{"delta": {}, "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                                              "prompt_tokens_details": {"cached_tokens": 4}}})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = _drive(handler)
    assert seen["url"] == "http://test/v1/chat/completions"
    body = seen["body"]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 3 and body["model"] == "m"
    assert body["messages"][0]["content"][-1] == {"type": "text", "text": "hello there"}
    assert r.ok and r.output_tokens == 3 and r.prompt_tokens == 9 and r.cached_tokens == 4
    assert r.finish_reason == "length" and len(r.itl_s) == 1 and r.ttft_s <= r.e2e_s


def test_driver_records_http_and_stream_errors():
    def rejected(request):
        return httpx.Response(429, json={"error": {"message": "saturated", "type": "rate_limit_error"}})

    r = _drive(rejected)
    assert r.status == "failed" and r.error == "HTTP 429: saturated"

    def broken(request):
        return httpx.Response(200, content=_sse({"choices": [{"delta": {"content": "a"}}]},
                                                {"error": {"message": "decode died"}}))

    r = _drive(broken)
    assert r.status == "failed" and "decode died" in r.error

    def empty(request):
        return httpx.Response(200, content=_sse({"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}))

    r = _drive(empty)
    assert r.status == "failed" and "without any output" in r.error

    def down(request):
        raise httpx.ConnectError("connection refused")

    r = _drive(down)
    assert r.status == "failed" and "ConnectError" in r.error


def test_normalize_base_url():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", "h:1"):
        assert normalize_base_url(url) == "http://h:1"


# ---- report ---------------------------------------------------------------------------------------


def test_table_sweep_and_json(tmp_path):
    records = [_record(0, 0.1, 0.2, 5), _record(1, None, None, 0, status="failed")]
    records[1].error = "HTTP 429: saturated"
    records[0].rate = math.inf
    client = summarize(records, 1.0, slo_ttft_ms=150)
    server = server_summary(parse_prometheus(PROM_BEFORE), parse_prometheus(PROM_AFTER), images_sent=2)
    run = {"rate": math.inf, "backend": "openai", "model": "m", "client": client, "server": server}
    table = format_table(run)
    for text in ("Successful requests", "Goodput", "SLO attainment", "P99 (ms)", "Encoder cache hit rate",
                 "1 x HTTP 429: saturated", "prefill_queue"):
        assert text in table
    assert "inf" in format_sweep([run, {**run, "rate": 2.0}])
    rec_path, sum_path = write_json(tmp_path, {"seed": 0}, [run], records)
    lines = [json.loads(line) for line in rec_path.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["rate"] == "inf" and lines[1]["status"] == "failed"
    summary = json.loads(sum_path.read_text())
    assert summary["runs"][0]["client"]["completed"] == 1 and summary["config"] == {"seed": 0}


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    bar = Progress(20, "r ", stream=out)
    for _ in range(20):
        bar.update(started=1)
        bar.update(done=1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 12 and lines[-1].startswith("r: 100%|#####") and "20/20" in lines[-1]
    assert "0 failed, 0 in flight" in lines[-1] and "\r" not in out.getvalue()


def test_progress_on_a_terminal_is_a_tqdm_bar():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    bar = Progress(4, "r ", stream=out)
    for _ in range(4):
        bar.update(started=1)
        bar.update(done=1, failed=1)
    bar.close()
    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "4 failed, 0 in flight" in text


def test_text_first_puts_the_prompt_ahead_of_the_images():
    from epd.bench.workload import RequestSpec

    spec = RequestSpec(index=0, prompt="a long context", images=[], output_len=4, arrival_s=0.0,
                       image_inputs=[b"\x89PNG1", b"\x89PNG2"])
    default = OpenAIDriver("http://test/v1", model="m").body(spec)["messages"][0]["content"]
    first = OpenAIDriver("http://test/v1", model="m", text_first=True).body(spec)["messages"][0]["content"]
    assert [p["type"] for p in default] == ["image_url", "image_url", "text"]
    assert [p["type"] for p in first] == ["text", "image_url", "image_url"]
    assert first[1:] == default[:2] and first[0] == default[2]
