"""Reading a real /metrics in tests: fetched, parsed by prometheus_client's parser (through the
bench's ``parse_prometheus``), summed over the series whose labels include the ones given."""
from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request

import pytest

from epd.bench.metrics import metric_sum, parse_prometheus


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The exposition text of a real /metrics (``sample_sum`` reads it)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def sample_sum(exposition: str | bytes, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples carrying ``labels`` (0 when the metric has none with them).
    A metric the exposition does not declare at all is an error (``KeyError`` naming it): a renamed
    or removed metric must fail a test that expects it to be 0, not pass it."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    if not _declares(text, name):
        raise KeyError(f"no metric {name!r} in this exposition (renamed or gone?); it declares: "
                       f"{sorted(_declared_families(text))}")
    return metric_sum(parse_prometheus(text), name, **labels) or 0.0


def _declared_families(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name for family in text_string_to_metric_families(text)}


def _declares(text: str, sample_name: str) -> bool:
    """Whether some family in ``text`` has samples called ``sample_name`` (its own name, or a
    counter's ``_total``, a histogram's ``_count`` / ``_sum`` / ``_bucket`` ...), even with none now."""
    families = _declared_families(text)
    return any(sample_name == family or (sample_name.startswith(family) and sample_name[len(family):] in _DERIVED)
               for family in families)


def every_registry(model_name: str = "test-model") -> dict[str, object]:
    """What the router and each tier serve on /metrics, built from the real metric classes with
    fakes for the objects they watch, one child of every labelled metric created (so every series
    a scrape can show is in the exposition): {"router" | tier: registry}."""
    from types import SimpleNamespace

    from epd.config import RouterConfig
    from epd.encoder.shared_store import SharedStoreStats
    from epd.router.autoscale import PlannerLoop
    from epd.router.metrics import RouterMetrics
    from epd.server.metrics import TierMetrics

    engine = SimpleNamespace(
        num_steps=0, step_seconds=0.0, num_batch_steps=0, num_overlapped_steps=0,
        scheduler=SimpleNamespace(waiting=[], running=[], importing=[]),
        block_manager=SimpleNamespace(usage=0.0, num_total_blocks=1, num_prefix_hit_tokens=0,
                                      num_prefix_query_tokens=0))
    encoder = SimpleNamespace(
        cache=SimpleNamespace(metrics=SimpleNamespace(hits=0, misses=0, bytes=0, evictions=0)),
        num_forwards=0, num_encoded_items=0, busy=SimpleNamespace(now=lambda: 0.0),
        scheduler=SimpleNamespace(num_waiting_requests=0),
        shared_store=SimpleNamespace(stats=SharedStoreStats()))
    store = SimpleNamespace(num_open_leases=0, open_bytes=0, num_ended_by_reason={"released": 1})

    router = RouterMetrics(model_name)
    PlannerLoop(RouterConfig(autoscale_budget=4),
                SimpleNamespace(workers={"encoder": [1], "prefill": [1], "decode": [1, 2]}), router)
    router.refresh_moves({"migrated": 1})
    router._encoder_counts = {("encoder", "127.0.0.1:1"): (3, 5)}
    tiers = {name: TierMetrics(name, model_name) for name in ("encoder", "prefill", "decode")}
    tiers["encoder"].watch_encoder(encoder)
    tiers["encoder"].watch_store(store)
    tiers["prefill"].watch_engine(engine)
    tiers["prefill"].watch_store(store)
    tiers["prefill"].store_reads().labels("read")
    tiers["decode"].watch_engine(engine)
    for owner in (router, *tiers.values()):
        for metric in vars(owner).values():
            labelnames = getattr(metric, "_labelnames", ())
            if labelnames and hasattr(metric, "labels"):
                metric.labels(*(["x"] * len(labelnames)))
    return {"router": router.registry, **{name: t.registry for name, t in tiers.items()}}


# Units that are not Prometheus's base units (seconds, bytes, ratios in [0, 1]), as name parts.
_NON_BASE_UNITS = {"ms", "millis", "milliseconds", "us", "microseconds", "ns", "minutes", "hours", "kb", "mb", "gb",
                   "kib", "mib", "gib", "percent", "pct"}
_HISTOGRAM_UNITS = ("_seconds", "_bytes", "_tokens", "_items")
_DERIVED = ("_total", "_created", "_count", "_sum", "_bucket")


def convention_problems(text: str, *, model_name: str | None = None) -> list[str]:
    """What breaks Prometheus's naming rules in one /metrics exposition, parsed by
    prometheus_client's parser: a counter's samples not ``_total``, a gauge or
    histogram family named like a derived series (``_total``, ``_count`` ...), a unit that is not a
    base unit, a histogram without a unit, an ``epd_`` sample without the ``model_name`` label (or
    with another value than ``model_name``), and no process metrics (CPU seconds, resident memory)."""
    from prometheus_client.parser import text_string_to_metric_families

    problems, families = [], {}
    for family in text_string_to_metric_families(text):
        if family.name in families:
            problems.append(f"{family.name}: two families of that name")
        families[family.name] = family
        if not family.name.startswith("epd_"):
            continue
        if family.type in ("gauge", "histogram", "summary") and family.name.endswith(_DERIVED):
            problems.append(f"{family.name}: a {family.type} named like a derived series")
        if family.type in ("untyped", "unknown"):
            problems.append(f"{family.name}: no TYPE line")
        if _NON_BASE_UNITS & set(family.name.split("_")):
            problems.append(f"{family.name}: not in base units (seconds, bytes, ratio)")
        if family.type == "histogram" and not family.name.endswith(_HISTOGRAM_UNITS):
            problems.append(f"{family.name}: a histogram whose name does not end in its unit")
        for sample in family.samples:
            if family.type == "counter" and not sample.name.endswith("_total"):
                problems.append(f"{sample.name}: a counter sample without _total")
            if "model_name" not in sample.labels:
                problems.append(f"{sample.name}{sample.labels}: no model_name label")
            elif model_name is not None and sample.labels["model_name"] != model_name:
                problems.append(f"{sample.name}: model_name {sample.labels['model_name']!r}, not {model_name!r}")
    for name in ("process_cpu_seconds", "process_resident_memory_bytes"):
        if name not in families:
            problems.append(f"{name}: missing (process metrics)")
    return problems


def promtool_problems(text: str) -> list[str]:
    """What Prometheus's own linter (``promtool check metrics``) says of one exposition, less the
    one rule vLLM's names break by design: ``vllm:*`` carries a colon (Prometheus keeps colons for
    recording rules), and the dashboards and autoscalers written for vLLM read exactly those names.
    promtool comes with the README's test setup (the Debian package ``prometheus``); without it
    the test is skipped here and fails in CI, where the setup must have installed it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed: scripts/setup.sh test installs the Debian package prometheus")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    problems = [line for line in lines if not (line.startswith("vllm:") and "should not contain ':'" in line)]
    if done.returncode not in (0, 3):  # 3: lint findings (listed); anything else: it could not read the text
        problems.append(f"promtool exited {done.returncode}")
    return problems
