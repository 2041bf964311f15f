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
    """Every sample of ``inner`` with ``labels`` added."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self._inner, self._labels = inner, labels

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            family.samples = [s._replace(labels={**self._labels, **s.labels}) for s in family.samples]
            yield family


def exposition(own: CollectorRegistry, model_name: str) -> CollectorRegistry:
    """The registry a process serves: ``own`` labelled with ``model_name``, and the process metrics
    (the default collectors read /proc/self, so each process reports itself)."""
    served = CollectorRegistry(auto_describe=False)
    served.register(_WithLabels(own, {"model_name": model_name}))
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        served.register(collector)
    return served


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
