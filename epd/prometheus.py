"""What every EPD process serves on ``/metrics``: its own metrics with a ``model_name`` label on
each sample (as vLLM labels its metrics, so one Prometheus can tell two deployments apart), plus
the standard process / platform / GC collectors (CPU seconds, resident memory, open files).

Counts that another object keeps (the block manager's prefix-cache tokens, the encoder cache's
hits, a worker's forwards seen in its health reply) are read at scrape time but exposed as
counters: they only go up (or reset when their process restarts, which ``rate()`` handles), so a
gauge would make every ``rate()`` over them wrong in Prometheus's eyes and linters'."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

LabelledValues = Iterable[tuple[Sequence[str], float]]

# No ``*_created`` series: in the text format they are a second, gauge-typed family per counter and
# histogram (a gauge whose name ends in a suffix Prometheus reserves), doubling the series a scrape
# stores for a timestamp ``rate()`` never needs.
disable_created_metrics()


class LiveCounters(Collector):
    """Counters whose value is read from a function at each scrape."""

    def __init__(self) -> None:
        self._counters: list[tuple[str, str, tuple[str, ...], Callable]] = []

    def add(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        self._counters.append((name, doc, (), fn))

    def add_labelled(self, name: str, doc: str, labelnames: Sequence[str], fn: Callable[[], LabelledValues]) -> None:
        """``fn`` returns (label values, count) pairs: one series each."""
        self._counters.append((name, doc, tuple(labelnames), fn))

    def collect(self) -> Iterator[Metric]:
        for name, doc, labelnames, fn in self._counters:
            family = CounterMetricFamily(name, doc, labels=labelnames)
            for values, count in (fn() if labelnames else [((), fn())]):
                family.add_metric(list(values), float(count))
            yield family


class _WithLabels(Collector):
    """Every sample of ``inner`` with ``labels`` added, and the families ``names`` maps again under
    the mapped name (one collection of ``inner`` a scrape)."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str], names: dict[str, str]) -> None:
        self._inner, self._labels, self._names = inner, labels, names

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            family.samples = [s._replace(labels={**self._labels, **s.labels}) for s in family.samples]
            yield family
            if (name := self._names.get(family.name)) is not None:
                yield _renamed(family, name)


# Ours under vLLM's names too, same meaning and labels: dashboards, alerts and autoscalers written
# for vLLM (llm-d's, KServe's, KEDA triggers on vllm:num_requests_waiting) read them unchanged. A
# worker's are its engine's (prefill or decode); the router's are the cluster's as its clients see it.
VLLM_NAMES = {
    "epd_running_requests": "vllm:num_requests_running",  # a worker's engine
    "epd_queue_depth": "vllm:num_requests_waiting",
    "epd_kv_block_usage_ratio": "vllm:kv_cache_usage_perc",  # vLLM's is a fraction too (1 = full)
    "epd_prefix_cache_hit_tokens": "vllm:prefix_cache_hits",
    "epd_prefix_cache_query_tokens": "vllm:prefix_cache_queries",
    "epd_router_in_flight": "vllm:num_requests_running",  # the router: requests on the tiers
    "epd_router_queue_depth": "vllm:num_requests_waiting",  # waiting for admission
    "epd_ttft_seconds": "vllm:time_to_first_token_seconds",
    "epd_tpot_seconds": "vllm:time_per_output_token_seconds",
    "epd_e2e_seconds": "vllm:e2e_request_latency_seconds",
    "epd_prompt_tokens": "vllm:prompt_tokens",
    "epd_output_tokens": "vllm:generation_tokens",
}


def _renamed(family: Metric, name: str) -> Metric:
    """``family`` again under ``name`` (vLLM's), its samples renamed alike."""
    renamed = Metric(name, f"{family.documentation} (vLLM's name for {family.name})", family.type, family.unit)
    renamed.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return renamed


def exposition(own: CollectorRegistry, model_name: str) -> CollectorRegistry:
    """The registry a process serves: ``own`` labelled with ``model_name``, the families vLLM has
    names for again under those (``VLLM_NAMES``), and the process metrics (the default collectors
    read /proc/self, so each process reports itself)."""
    served = CollectorRegistry(auto_describe=False)
    served.register(_WithLabels(own, {"model_name": model_name}, VLLM_NAMES))
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        served.register(collector)
    return served


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
