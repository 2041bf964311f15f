"""``epd bench`` end to end against a fake router on 127.0.0.1 (the real HTTP app and gRPC service
over a core with fixed delays): the numbers it reports match the delays, --out writes its files,
the gRPC backend works, and --max-duration-s stops the run on time."""
from __future__ import annotations

import json
import time

import pytest

from epd.bench.cli import main
from tests.bench.fake_server import DelayCore, serve_fake

FIRST_DELAY_S, ITL_S = 0.05, 0.005


@pytest.fixture(scope="module")
def fake():
    core = DelayCore(first_delay_s=FIRST_DELAY_S, itl_s=ITL_S)
    with serve_fake(core) as (url, address):
        yield core, url, address


def _summary(out_dir):
    return json.loads((out_dir / "summary.json").read_text())


def test_openai_backend_numbers_and_files(fake, tmp_path, capsys):
    core, url, _ = fake
    out = tmp_path / "out"
    before_images, before_requests = len(core.images_seen), len(core.requests)
    rc = main(["--base-url", url + "/v1", "--num-prompts", "16", "--request-rate", "inf", "--max-concurrency", "2",
               "--output-len", "8", "--input-len", "20", "--image-size", "64x64:1,96x64:1", "--repeat-ratio", "0.5",
               "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--seed", "3", "--out", str(out),
               "--scrape-interval-s", "0.2", "--settle-s", "0"])
    assert rc == 0
    printed = capsys.readouterr()
    assert "Time to First Token" in printed.out and "Encoder cache hit rate" in printed.out
    assert "16/16" in printed.err and "0 failed, 0 in flight" in printed.err  # the progress line

    # every request asked for exactly O tokens with EOS ignored, and got them
    sent = core.requests[before_requests:]
    assert len(sent) == 17  # one warm-up + 16
    assert all(r.sampling.max_tokens == 8 and r.sampling.ignore_eos for r in sent[1:])
    run = _summary(out)["runs"][0]
    c, s = run["client"], run["server"]
    assert (c["completed"], c["failed"], c["total_output_tokens"]) == (16, 0, 16 * 8)
    # TTFT is the fake's first-token delay plus local overhead; TPOT its token gap
    assert FIRST_DELAY_S * 1000 <= c["ttft_ms"]["p50"] <= FIRST_DELAY_S * 1000 + 80
    assert ITL_S * 1000 <= c["tpot_ms"]["p50"] <= ITL_S * 1000 + 20
    assert c["itl_ms"]["count"] == 16 * 7
    assert c["e2e_ms"]["mean"] >= c["ttft_ms"]["mean"] + 7 * ITL_S * 1000 * 0.9
    assert c["goodput"] == pytest.approx(c["request_throughput"]) and c["slo_attainment_pct"] == 100.0
    assert c["output_throughput"] == pytest.approx(c["total_output_tokens"] / c["duration_s"])
    assert c["total_prompt_tokens"] == 16 * core.prompt_len and c["total_cached_tokens"] == 16 * 4
    # the encoder-cache hit rate from /metrics equals the share of repeated images sent
    new_images = len(core.images_seen) - before_images - 1  # the warm-up's image is not in the run
    assert s["encoder_encoded_items"] == new_images
    assert s["encoder_cache_hit_rate"] == pytest.approx(c["repeated_images_sent"] / c["images_sent"])
    assert c["repeated_images_sent"] > 0
    assert s["requests_by_outcome"] == {"ok": 16.0}
    assert FIRST_DELAY_S * 1000 <= s["server_ttft_mean_ms"] <= c["ttft_ms"]["mean"] + 1
    assert s["queues"]["decode_queue"]["max"] is not None  # sampled during the run

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(r["status"] == "ok" and r["output_tokens"] == 8 for r in records)
    for name in ("ttft_cdf.png", "tpot_cdf.png", "latency_over_time.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_rate_sweep_writes_attainment_plot(fake, tmp_path, capsys):
    _, url, _ = fake
    out = tmp_path / "sweep"
    rc = main(["--base-url", url, "--num-prompts", "6", "--request-rate", "20,40", "--burstiness", "2",
               "--output-len", "4", "--images-per-request", "0", "--slo-ttft-ms", "5000", "--out", str(out),
               "--no-progress", "--warmup-requests", "0", "--settle-s", "0"])
    assert rc == 0
    runs = _summary(out)["runs"]
    assert [r["rate"] for r in runs] == [20.0, 40.0]
    assert all(r["client"]["completed"] == 6 for r in runs)
    assert "goodput" in capsys.readouterr().out  # the sweep table
    data = (out / "slo_attainment_vs_rate.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_grpc_backend(fake, tmp_path):
    core, url, address = fake
    out = tmp_path / "grpc"
    before = len(core.requests)
    rc = main(["--backend", "grpc", "--grpc-address", address, "--base-url", url, "--num-prompts", "6",
               "--output-len", "5", "--image-size", "32x32", "--out", str(out), "--no-plots", "--no-progress"])
    assert rc == 0
    assert all(r.sampling.ignore_eos and r.sampling.max_tokens == 5 for r in core.requests[before + 1:])
    c = _summary(out)["runs"][0]["client"]
    assert (c["completed"], c["total_output_tokens"]) == (6, 30)
    assert FIRST_DELAY_S * 1000 <= c["ttft_ms"]["p50"] <= FIRST_DELAY_S * 1000 + 80
    assert c["total_prompt_tokens"] == 6 * core.prompt_len
    assert not list(out.glob("*.png"))


def test_failures_are_counted_not_fatal(tmp_path):
    core = DelayCore(first_delay_s=0.01, itl_s=0.001, fail_every=3)
    with serve_fake(core) as (url, _):
        out = tmp_path / "fail"
        rc = main(["--base-url", url, "--num-prompts", "9", "--output-len", "3", "--images-per-request", "0",
                   "--warmup-requests", "0", "--max-concurrency", "1", "--out", str(out), "--no-plots",
                   "--no-progress", "--slo-ttft-ms", "10000", "--settle-s", "0"])
    assert rc == 0
    c = _summary(out)["runs"][0]["client"]
    assert (c["completed"], c["failed"]) == (6, 3)
    assert c["slo_attainment_pct"] == pytest.approx(100 * 6 / 9)
    assert list(c["errors"]) == ["HTTP 429: saturated (fake)"]


def test_max_duration_stops_issuing_and_cancels_at_the_grace_deadline(tmp_path):
    core = DelayCore(first_delay_s=0.01, itl_s=1.0)  # 50 tokens: 50 s per request
    with serve_fake(core) as (url, _):
        out = tmp_path / "deadline"
        t0 = time.monotonic()
        rc = main(["--base-url", url, "--num-prompts", "100", "--request-rate", "10", "--output-len", "50",
                   "--images-per-request", "0", "--max-duration-s", "0.5", "--grace-s", "0.3",
                   "--warmup-requests", "0", "--out", str(out), "--no-plots", "--no-progress", "--settle-s", "0"])
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while core.active and time.monotonic() < deadline:  # the server saw the clients go
            time.sleep(0.05)
        assert core.active == 0
    assert rc == 1  # nothing completed
    assert elapsed < 25, elapsed  # cut at 0.5 + 0.3 s, not waited for: one request alone takes 50 s
    c = _summary(out)["runs"][0]["client"]
    assert c["completed"] == 0 and c["cancelled"] == c["num_requests"] >= 1
    assert c["not_sent"] == 100 - c["num_requests"] and c["not_sent"] > 80
    assert 0.7 <= c["duration_s"] < 25  # from the first request to the cut, not to a request's end
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["status"] == "cancelled" and r["ttft_s"] is not None for r in records)


def test_a_jsonl_dataset_over_both_backends_with_chosen_percentiles(fake, tmp_path, capsys):
    """--dataset-name jsonl: local files (read once, sent as bytes; one sent twice), a data: URL,
    each line's output length; --percentile-metrics / --metric-percentiles pick the table's rows."""
    import base64
    import hashlib

    from tests.conftest import make_image_bytes

    core, url, address = fake
    (tmp_path / "img").mkdir()
    a, b, c = (make_image_bytes(40 + 8 * i, 32, seed=70 + i) for i in range(3))
    (tmp_path / "img" / "a.png").write_bytes(a)
    (tmp_path / "b.png").write_bytes(b)
    lines = [{"prompt": "First.", "images": ["img/a.png"], "output_len": 3},
             {"prompt": "Second.", "images": [f"file://{tmp_path}/b.png", "img/a.png"], "max_tokens": 5},
             {"prompt": "Third.", "images": ["data:image/png;base64," + base64.b64encode(c).decode()]},
             {"prompt": "Text only."}]
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    for backend in ("openai", "grpc"):
        before = len(core.requests)
        out = tmp_path / backend
        rc = main(["--backend", backend, "--grpc-address", address, "--base-url", url, "--dataset-name", "jsonl",
                   "--dataset-path", str(dataset), "--output-len", "4", "--warmup-requests", "0", "--out", str(out),
                   "--no-plots", "--no-progress", "--settle-s", "0", "--max-concurrency", "1",
                   "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "95,99.9"])
        assert rc == 0
        sent = core.requests[before:]
        assert [r.sampling.max_tokens for r in sent] == [3, 5, 4, 4]
        images = [[hashlib.sha256(p["image"]).digest() for m in r.messages for p in m["content"]
                   if isinstance(m["content"], list) and p.get("type") == "image"] for r in sent]
        digest = {k: hashlib.sha256(v).digest() for k, v in (("a", a), ("b", b), ("c", c))}
        assert images == [[digest["a"]], [digest["b"], digest["a"]], [digest["c"]], []]
        client = _summary(out)["runs"][0]["client"]
        assert (client["completed"], client["images_sent"], client["repeated_images_sent"]) == (4, 4, 1)
        assert client["ttft_ms"]["p95"] is not None and client["ttft_ms"]["p99.9"] is not None
        table = capsys.readouterr().out
        assert "Time to First Token" in table and "End-to-end Latency" in table and "P99.9 (ms)" in table
        assert "Time per Output Token" not in table and "P50 (ms)" not in table


def test_extra_body_reaches_every_request(fake, tmp_path):
    core, url, _ = fake
    before = len(core.requests)
    rc = main(["--base-url", url, "--num-prompts", "3", "--output-len", "2", "--images-per-request", "0",
               "--warmup-requests", "0", "--no-progress", "--settle-s", "0",
               "--extra-body", '{"stop": ["zzz"], "seed": 5}'])
    assert rc == 0
    sent = core.requests[before:]
    assert len(sent) == 3 and all(r.stop_strings == ["zzz"] and r.sampling.seed == 5 for r in sent)


@pytest.mark.parametrize("args,said", [
    (["--dataset-name", "jsonl"], "--dataset-path goes with --dataset-name jsonl"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics: expected a comma list"),
    (["--metric-percentiles", "0,50"], "--metric-percentiles: expected"),
    (["--random-mm-bucket-config", "{(64, 64, 4): 1.0}"], "a video"),
    (["--random-range-ratio", "1.5"], "range_ratio must be in [0, 1)"),
    (["--extra-body", "[1]"], "--extra-body: expected a JSON object"),
    (["--extra-body", "{}", "--backend", "grpc"], "--extra-body needs --backend openai"),
])
def test_bad_workload_options_are_one_line_naming_them(args, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--base-url", "http://127.0.0.1:9", *args])
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_the_profiles_pipeline_client_is_the_bench_driver_and_times_what_it_sends(fake):
    """``epd profile --pipeline`` sends its requests through ``epd bench``'s own driver, as a bench
    run does (no temperature: the API's default, sampled), and reads TTFT and time per token the
    way the bench does."""
    from epd.bench.pipeline_client import PipelineClient

    core, url, _ = fake
    client = PipelineClient(url, core.model_name)
    try:
        ttft_ms, per_token_ms, prompt_tokens = client.one(None, max_tokens=6)
        assert FIRST_DELAY_S * 1000 <= ttft_ms < FIRST_DELAY_S * 1000 + 200
        assert ITL_S * 1000 * 0.8 <= per_token_ms < ITL_S * 1000 + 20 and prompt_tokens == core.prompt_len
        assert core.requests[-1].sampling.temperature == 1.0 and core.requests[-1].sampling.max_tokens == 6
        assert len(client.at_once(3)) == 3
    finally:
        client.close()


def test_the_profiles_paced_streams_send_on_time_and_say_how_many_decoded_at_once(fake):
    """``epd profile --pipeline`` measures the CPU of a loaded cluster on paced streams: each request
    sent an interval after the one before, not waiting for it, and the stream's mean decode batch
    read from when each one's first and last tokens came. Requests of 6 tokens decode for 5 x 5 ms:
    sent every 12.5 ms, four of them overlap by half (100 ms of decoding over 62.5: 1.6 at once);
    sent every 200 ms, one at a time (1.0). Sent one after another, they would never overlap."""
    from epd.bench.pipeline_client import PipelineClient, mean_overlap

    assert mean_overlap([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(5.0 / 4.0)
    assert mean_overlap([]) == 1.0
    core, url, _ = fake
    client = PipelineClient(url, core.model_name)
    try:
        client.one(None, max_tokens=6)  # the driver's connection made
        assert 1.3 < client.paced(4, 2.5 * ITL_S, max_tokens=6) < 2.0
        assert client.paced(3, 0.2, max_tokens=6) == pytest.approx(1.0, abs=0.05)
    finally:
        client.close()
