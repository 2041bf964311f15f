"""The Grafana dashboard (deploy/grafana/epd-dashboard.json) queries only metrics the code exports.

The exported names come from the real metric objects: RouterMetrics and one TierMetrics per tier
watching fakes with the attributes the tiers read (tests.prom.every_registry), rendered to the
Prometheus text format and parsed back (so `_total`, `_bucket`, `_sum`, `_count` are exactly what a scrape shows)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.prom import every_registry

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "epd-dashboard.json"
# labels Prometheus attaches to every target (the chart's ServiceMonitor adds epd_tier / epd_release)
TARGET_LABELS = {"epd_tier", "epd_release", "namespace", "instance", "job", "pod", "service", "container",
                 "endpoint"}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "topk", "bottomk", "quantile", "stddev", "by", "without", "on",
    "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "rate", "irate", "increase", "delta", "histogram_quantile", "clamp_min", "clamp_max", "abs", "label_values",
    "sum_over_time", "avg_over_time", "max_over_time", "min_over_time", "vector", "scalar", "time",
}
# ours (and vLLM's names for some of them), and the process / Python collectors every process serves too
METRIC_PREFIXES = ("epd_", "vllm:", "process_", "python_")
_TOKEN = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:ms|[smhdwy]\b)?|[a-zA-Z_:][a-zA-Z0-9_:]*|\S")


def exported() -> dict[str, set[str]]:
    """Every series name a scrape of the router or any worker shows -> its label names."""
    names: dict[str, set[str]] = {}
    for registry in every_registry().values():
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(dash: dict) -> list[str]:
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))
    walk(dash["panels"])
    return exprs


def parse(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, label names used, other identifiers) of one PromQL expression."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (matcher values, variables)
    labels: set[str] = set()
    for block in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", block))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels.update(label.strip() for label in clause.split(",") if label.strip())
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    metrics, words = set(), set()
    for token in _TOKEN.findall(text):
        if re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", token):
            (metrics if token.startswith(METRIC_PREFIXES) else words).add(token)
    return metrics, labels, words


def test_parser_strips_labels_groupings_and_variables():
    metrics, labels, words = parse(
        'histogram_quantile(0.99, sum by (le, epd_tier) (rate(epd_ttft_seconds_bucket{epd_release=~"$release", '
        'outcome!="x"}[$__rate_interval]))) / clamp_min(sum(epd_requests_total offset 5m), 1e-9)')
    assert metrics == {"epd_ttft_seconds_bucket", "epd_requests_total"}
    assert labels == {"le", "epd_tier", "epd_release", "outcome"}
    assert words == {"histogram_quantile", "sum", "rate", "clamp_min", "offset"}


def test_every_queried_metric_is_exported():
    names = exported()
    queried: dict[str, str] = {}
    for expr in expressions(dashboard()):
        metrics, _, _ = parse(expr)
        for m in metrics:
            queried.setdefault(m, expr)
    assert queried, "the dashboard queries nothing"
    unknown = {m: e for m, e in queried.items() if m not in names}
    assert not unknown, f"queried but not exported: {sorted(unknown)}; exported: {sorted(names)}"


def test_expressions_use_only_promql_words_and_known_labels():
    names = exported()
    for expr in expressions(dashboard()):
        metrics, labels, words = parse(expr)
        assert metrics, expr
        stray = words - PROMQL_WORDS
        assert not stray, f"not a PromQL word nor an exported metric: {stray} in {expr}"
        available = set().union(*(names.get(m, set()) for m in metrics)) | TARGET_LABELS | {"le"}
        assert labels <= available, f"labels {labels - available} exist on none of {metrics}: {expr}"
        for m in metrics:
            if m.endswith("_bucket"):  # buckets only make sense summed by le under histogram_quantile
                assert "histogram_quantile(" in expr and re.search(r"by \(le\b", expr), expr


def test_dashboard_covers_the_issue():
    queried = set().union(*(parse(e)[0] for e in expressions(dashboard())))
    required = {
        "epd_requests_total", "epd_tier_requests_total", "epd_output_tokens_total",      # throughput
        "epd_ttft_seconds_bucket", "epd_tpot_seconds_bucket", "epd_e2e_seconds_bucket",   # latency percentiles
        "epd_router_queue_depth", "vllm:num_requests_waiting", "epd_encoder_queue_depth",  # queues
        "vllm:num_requests_running",                                        # vLLM's names, as its dashboards
        "epd_encoder_cache_hits_total", "epd_encoder_cache_misses_total", "epd_encoder_cache_bytes",  # encoder cache
        "epd_transfer_bytes_total",                                                       # bandwidth by transport
        "epd_kv_block_usage_ratio",                                                       # KV usage
        "epd_admission_rejections_total",                                                 # admission
    }
    assert required <= queried, sorted(required - queried)
    bandwidth = [e for e in expressions(dashboard()) if "epd_transfer_bytes_total" in e]
    assert any("transport" in parse(e)[1] for e in bandwidth)


def test_dashboard_is_importable():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    names = exported()
    for var in variables.values():
        if var["type"] != "query":
            continue
        metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["definition"]).groups()
        assert metric in names and label in TARGET_LABELS | names[metric]
    ids = []

    def walk(panels):
        for panel in panels:
            ids.append(panel["id"])
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                refs = [t["refId"] for t in panel["targets"]]
                assert refs and len(refs) == len(set(refs))
            walk(panel.get("panels", []))
    walk(dash["panels"])
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("suffix", ["_bucket", "_sum", "_count"])
def test_histogram_series_are_what_a_scrape_shows(suffix):
    """Guards the name collection itself: a histogram exports these, a counter _total (no _created:
    epd.prometheus turns those off)."""
    names = exported()
    assert f"epd_ttft_seconds{suffix}" in names and "epd_ttft_seconds_created" not in names
    assert "epd_requests_total" in names and "epd_requests" not in names
    assert "epd_kv_block_usage_ratio" in names  # a live gauge, as is
