"""Every /metrics exposition follows Prometheus's conventions (tests.prom.convention_problems):
counters are ``_total``, no gauge looks like one, base units, a ``model_name`` label like vLLM's,
process metrics on every process. Real processes are checked by tests/e2e/test_openai_serve.py."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from epd.prometheus import LiveCounters, exposition
from tests.prom import convention_problems, every_registry, promtool_problems, sample_sum


@pytest.mark.parametrize("process", ["router", "encoder", "prefill", "decode"])
def test_every_process_exposition_follows_the_conventions(process):
    text = generate_latest(every_registry(model_name="qwen-test")[process]).decode()
    assert convention_problems(text, model_name="qwen-test") == []
    assert sample_sum(text, "process_resident_memory_bytes") > 0


def test_counts_kept_elsewhere_are_counters_read_at_scrape():
    from prometheus_client import CollectorRegistry

    own, value = CollectorRegistry(), {"n": 3}
    counts = LiveCounters()
    counts.add("epd_things", "things done", lambda: value["n"])
    counts.add_labelled("epd_moves", "moves", ["stage"], lambda: [(("a",), 1), (("b",), 2)])
    own.register(counts)
    served = exposition(own, "m")
    value["n"] = 7
    text = generate_latest(served).decode()
    assert "# TYPE epd_things_total counter" in text or "# TYPE epd_things counter" in text
    assert sample_sum(text, "epd_things_total", model_name="m") == 7
    assert sample_sum(text, "epd_moves_total", stage="b") == 2
    assert convention_problems(text) == []


@pytest.mark.parametrize("bad,found", [
    ("# TYPE epd_kv_blocks_total gauge\nepd_kv_blocks_total{model_name=\"m\"} 3\n", "gauge named like a derived"),
    ("# TYPE epd_ttft_ms histogram\nepd_ttft_ms_bucket{le=\"+Inf\",model_name=\"m\"} 1\n"
     "epd_ttft_ms_count{model_name=\"m\"} 1\nepd_ttft_ms_sum{model_name=\"m\"} 1\n", "base units"),
    ("# TYPE epd_hits gauge\nepd_hits 3\n", "no model_name label"),
    ("epd_hits{model_name=\"m\"} 3\n", "no TYPE line"),
])
def test_the_checker_finds_each_kind_of_mistake(bad, found):
    process = "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 1\n" \
              "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 1\n"
    problems = convention_problems(bad + process)
    assert any(found in p for p in problems), problems
    assert any("process metrics" in p for p in convention_problems(bad))


@pytest.mark.parametrize("process", ["router", "encoder", "prefill", "decode"])
def test_promtool_finds_nothing_in_each_process_exposition(process):
    text = generate_latest(every_registry(model_name="qwen-test")[process]).decode()
    assert promtool_problems(text) == []


def test_promtool_is_live_and_reads_what_it_is_given():
    """The lint above can fail: a counter without ``_total`` and a name in camelCase are found, and a
    vllm: name passes only for its colon."""
    bad = ("# HELP epd_requests requests\n# TYPE epd_requests counter\nepd_requests 1\n"
           "# HELP epd_queueDepth depth\n# TYPE epd_queueDepth gauge\nepd_queueDepth 1\n"
           "# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n"
           "vllm:num_requests_running 0\n")
    problems = promtool_problems(bad)
    assert any("epd_requests" in p and "_total" in p for p in problems), problems
    assert any("epd_queueDepth" in p for p in problems), problems
    assert not any(p.startswith("vllm:") for p in problems), problems
