"""Numbers of a run: percentiles, the latency summary, goodput and SLO attainment, and the server's
view from its Prometheus ``/metrics`` (parsed here, scraped before / during / after a run)."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

PERCENTILES = (50, 90, 99)

# ---- percentiles and summaries ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics, as
    ``numpy.percentile``'s default; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    frac = pos - lo
    return data[lo] + (data[hi] - data[lo]) * frac


def distribution_ms(values_s: Iterable[float | None], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """mean / the percentiles (keys ``p50``, ``p99.9``) / max in milliseconds of the values given in
    seconds (None skipped)."""
    data = [v * 1000.0 for v in values_s if v is not None]
    out: dict = {"count": len(data), "mean": (sum(data) / len(data)) if data else None}
    for q in percentiles:
        out[percentile_key(q)] = percentile(data, q)
    out["max"] = max(data) if data else None
    return out


def percentile_key(q: float) -> str:
    return f"p{q:g}"


def meets_slo(record, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request whose TTFT and TPOT are within the SLOs given (an SLO not given always
    holds)."""
    if not record.ok or record.ttft_s is None:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    tpot = record.tpot_s
    if slo_tpot_ms is not None and (tpot is None or tpot * 1000.0 > slo_tpot_ms):
        return False
    return True


def summarize(records: Sequence, duration_s: float, *, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, num_not_sent: int = 0,
              percentiles: Sequence[float] = PERCENTILES) -> dict:
    """The client-side summary of one run. Goodput counts completed requests meeting every SLO
    given, per second of run; attainment is their share of the requests sent. Latencies get
    ``percentiles`` and always p50 and p99 (the sweep table's)."""
    qs = sorted({*percentiles, 50, 99})
    ok = [r for r in records if r.ok]
    failed = [r for r in records if r.status == "failed"]
    cancelled = [r for r in records if r.status in ("cancelled", "not_started")]
    out_tokens = sum(r.output_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": len(cancelled),
        "not_sent": num_not_sent,
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "images_sent": sum(r.num_images for r in records if r.start_s is not None),
        "repeated_images_sent": sum(r.num_repeated_images for r in records if r.start_s is not None),
        "ttft_ms": distribution_ms((r.ttft_s for r in ok), qs),
        "tpot_ms": distribution_ms((r.tpot_s for r in ok if r.output_tokens > 1), qs),
        "itl_ms": distribution_ms((v for r in ok for v in r.itl_s), qs),
        "e2e_ms": distribution_ms((r.e2e_s for r in ok), qs),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "errors": _error_counts(failed),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r in ok if meets_slo(r, slo_ttft_ms, slo_tpot_ms))
        summary["good_requests"] = good
        summary["goodput"] = good / duration_s
        summary["slo_attainment_pct"] = 100.0 * good / len(records) if records else None
    else:
        summary["good_requests"] = summary["goodput"] = summary["slo_attainment_pct"] = None
    return summary


def _error_counts(failed: Sequence) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown")[:120]
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:10])


# ---- Prometheus text format ---------------------------------------------------------------------

Labels = tuple[tuple[str, str], ...]


def parse_prometheus(text: str) -> dict[str, dict[Labels, float]]:
    """Prometheus text exposition -> {sample name: {sorted (label, value) pairs: value}}, parsed by
    ``prometheus_client``'s own parser (so escapes, timestamps, ``+Inf``/``NaN`` are read as
    Prometheus reads them). A malformed exposition raises ``ValueError`` naming the problem."""
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return out


def metric_sum(parsed: dict | None, name: str, **match: str) -> float | None:
    """Sum of a metric's samples whose labels include ``match``; None when it has none."""
    if not parsed or name not in parsed:
        return None
    values = [v for labels, v in parsed[name].items() if all((k, val) in labels for k, val in match.items())]
    return sum(values) if values else None


def metric_by_label(parsed: dict | None, name: str, label: str) -> dict[str, float]:
    """A metric's samples summed per value of one label."""
    out: dict[str, float] = {}
    for labels, v in (parsed or {}).get(name, {}).items():
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + v
    return out


def _delta(before: dict | None, after: dict | None, name: str, **match: str) -> float | None:
    a = metric_sum(after, name, **match)
    if a is None:
        return None
    b = metric_sum(before, name, **match)
    return a - (b or 0.0)


def server_summary(before: dict | None, after: dict | None, samples: Sequence[dict] = (), *,
                   images_sent: int = 0) -> dict:
    """The server's side of a run from the scrapes: counter deltas, the encoder-cache hit rate,
    prefix-cache hit share, server-side TTFT / E2E means, and queue depths (per tier and the
    router's admission queue) before, after, and their mean / max over the samples taken."""
    if after is None:
        return {"available": False}
    out: dict = {"available": True}
    outcomes = {}
    for outcome in metric_by_label(after, "epd_requests_total", "outcome"):
        outcomes[outcome] = _delta(before, after, "epd_requests_total", outcome=outcome)
    out["requests_by_outcome"] = outcomes
    rejections = {}
    for reason in metric_by_label(after, "epd_admission_rejections_total", "reason"):
        rejections[reason] = _delta(before, after, "epd_admission_rejections_total", reason=reason)
    out["admission_rejections"] = rejections
    for key, name in (("prompt_tokens", "epd_prompt_tokens_total"), ("output_tokens", "epd_output_tokens_total"),
                      ("prefix_cache_hit_tokens", "epd_prompt_cached_tokens_total"),
                      ("encoder_forwards", "epd_encoder_forwards_total"),
                      ("encoder_encoded_items", "epd_encoder_encoded_items_total")):
        out[key] = _delta(before, after, name)
    if out["prefix_cache_hit_tokens"] is not None and out["prompt_tokens"]:
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / out["prompt_tokens"]
    else:
        out["prefix_cache_hit_rate"] = None
    # encoder cache: the workers' own hit/miss counters when scraped, else items sent vs encoded
    hits = _delta(before, after, "epd_encoder_cache_hits_total")
    misses = _delta(before, after, "epd_encoder_cache_misses_total")
    if hits is not None and misses is not None and hits + misses > 0:
        out["encoder_cache_hit_rate"], out["encoder_cache_hit_rate_source"] = hits / (hits + misses), "worker"
    elif out["encoder_encoded_items"] is not None and images_sent > 0:
        rate = 1.0 - out["encoder_encoded_items"] / images_sent
        out["encoder_cache_hit_rate"] = min(1.0, max(0.0, rate))
        out["encoder_cache_hit_rate_source"] = "router"
    else:
        out["encoder_cache_hit_rate"] = out["encoder_cache_hit_rate_source"] = None
    for key, base in (("server_ttft_mean_ms", "epd_ttft_seconds"), ("server_tpot_mean_ms", "epd_tpot_seconds"),
                      ("server_e2e_mean_ms", "epd_e2e_seconds")):
        s, n = _delta(before, after, base + "_sum"), _delta(before, after, base + "_count")
        out[key] = 1000.0 * s / n if s is not None and n else None
    out["queues"] = queue_figures(before, after, samples)
    return out


def queue_snapshot(parsed: dict | None) -> dict[str, float]:
    """Queue depths now: the router's admission queue, and per tier the sum over its workers
    (``epd_worker_queue_depth``), plus requests running per tier."""
    if not parsed:
        return {}
    snap: dict[str, float] = {}
    router_q = metric_sum(parsed, "epd_router_queue_depth")
    if router_q is not None:
        snap["router_queue"] = router_q
    in_flight = metric_sum(parsed, "epd_router_in_flight")
    if in_flight is not None:
        snap["router_in_flight"] = in_flight
    for tier, v in metric_by_label(parsed, "epd_worker_queue_depth", "tier").items():
        snap[f"{tier}_queue"] = v
    for tier, v in metric_by_label(parsed, "epd_worker_running", "tier").items():
        snap[f"{tier}_running"] = v
    return snap


def queue_figures(before: dict | None, after: dict | None, samples: Sequence[dict] = ()) -> dict[str, dict]:
    b, a = queue_snapshot(before), queue_snapshot(after)
    during = [s["queues"] for s in samples if s.get("queues")]
    out = {}
    for key in sorted(set(a) | set(b) | {k for s in during for k in s}):
        values = [s[key] for s in during if key in s]
        out[key] = {"before": b.get(key), "after": a.get(key),
                    "delta": (a[key] - b.get(key, 0.0)) if key in a else None,
                    "mean": sum(values) / len(values) if values else None,
                    "max": max(values) if values else None, "samples": len(values)}
    return out


class MetricsSampler:
    """Scrapes Prometheus endpoints (the router's ``/metrics`` and any others given) and merges
    them; ``run()`` samples queue depths every ``interval_s`` until cancelled."""

    def __init__(self, urls: Sequence[str], *, interval_s: float = 1.0, timeout_s: float = 5.0) -> None:
        self.urls, self.interval_s, self.timeout_s = list(urls), interval_s, timeout_s
        self._samples: list[dict] = []
        self._bodies: list[tuple[float, list[tuple[str, str]]]] = []  # scrapes during the run, unparsed
        self.errors: list[str] = []
        self._t0 = time.perf_counter()
        # One HTTP client for every scrape, made before the run starts (the first scrape). Why: a
        # client made per scrape builds its TLS context each time, ~30 ms of CPU once a second on
        # the event loop that also reads and timestamps the streams (docs/benchmarks.md: what the
        # bench's own scrapes cost).
        self._client = None

    async def scrape(self) -> dict | None:
        """Every endpoint's metrics now, merged (None: none answered)."""
        return self._merge(await self._fetch())

    async def _fetch(self) -> list[tuple[str, str]]:
        """(url, body) of each endpoint that answered."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        bodies = []
        for url in self.urls:
            try:
                resp = await self._client.get(url)
                resp.raise_for_status()
            except Exception as exc:  # a metrics endpoint down must not stop the bench
                self._error(url, exc)
                continue
            bodies.append((url, resp.text))
        return bodies

    def _merge(self, bodies: list[tuple[str, str]]) -> dict | None:
        merged: dict[str, dict] = {}
        got = False
        for url, text in bodies:
            try:
                parsed = parse_prometheus(text)
            except Exception as exc:  # a malformed one neither
                self._error(url, exc)
                continue
            got = True
            for name, series in parsed.items():
                target = merged.setdefault(name, {})
                for labels, v in series.items():
                    # the same series from two endpoints (e.g. two workers without a worker
                    # label): keep both by tagging the endpoint
                    if labels in target:
                        labels = labels + (("_endpoint", url),)
                    target[labels] = v
        return merged if got else None

    def _error(self, url: str, exc: Exception) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{url}: {type(exc).__name__}: {exc}")

    @property
    def samples(self) -> list[dict]:
        """The scrapes during the run: when (seconds after ``run()`` started) and the queue depths.
        Parsed here, once the run is over, not as they come: parsing a router's metrics takes a few
        ms of the event loop that reads and timestamps the streams."""
        while self._bodies:
            t_s, bodies = self._bodies.pop(0)
            if (parsed := self._merge(bodies)) is not None:
                self._samples.append({"t_s": t_s, "queues": queue_snapshot(parsed)})
        return self._samples

    async def aclose(self) -> None:
        """Close the scrapes' HTTP client (its connections); a later scrape opens another."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def run(self) -> None:
        self._t0 = time.perf_counter()
        while True:
            await asyncio.sleep(self.interval_s)
            bodies = await self._fetch()
            self._bodies.append((time.perf_counter() - self._t0, bodies))
