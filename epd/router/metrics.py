"""The router's Prometheus metrics (prefix ``epd_``) and the cluster view built from health checks."""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epd.prometheus import LiveCounters, exposition, render

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ADMISSION_REASONS = {400: "never_fits", 429: "saturated", 503: "no_workers"}
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class RouterMetrics:
    def __init__(self, model_name: str, router_index: int = 0) -> None:
        self.own = r = CollectorRegistry()
        self.registry = exposition(r, model_name)  # what /metrics serves
        # which of epd serve's routers answered (with --routers N they share one port)
        Gauge("epd_router_info", "This router process (its index among the routers sharing the port)", ["router"],
              registry=r).labels(str(router_index)).set(1)
        self.requests = Counter("epd_requests", "Requests finished, by outcome", ["outcome"], registry=r)
        self.rejections = Counter("epd_admission_rejections", "Requests refused at admission, by reason",
                                  ["reason"], registry=r)
        self.ttft = Histogram("epd_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("epd_tpot_seconds", "Time per output token after the first",
                              buckets=_TOKEN_BUCKETS_S, registry=r)
        self.e2e = Histogram("epd_e2e_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS_S,
                             registry=r)
        self.queue_depth = Gauge("epd_router_queue_depth", "Requests waiting for an admission slot", registry=r)
        self.in_flight = Gauge("epd_router_in_flight", "Requests on the tiers", registry=r)
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=1024)  # (monotonic s, TTFT s): the planner's
        self.prompt_tokens = Counter("epd_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.output_tokens = 0  # streamed so far: added to per output, read at scrape (a prometheus
        # Counter's inc took a lock and two checks for every streamed step of every request)
        self.cached_tokens = Counter("epd_prompt_cached_tokens", "Prompt tokens of the requests admitted that "
                                     "prefill served from its prefix cache", registry=r)
        # the cluster view, refreshed from the health checks
        labels = ["tier", "worker"]
        self.worker_healthy = Gauge("epd_worker_healthy", "1 if the worker is in rotation", labels, registry=r)
        self.worker_running = Gauge("epd_worker_running", "Requests running on the worker", labels, registry=r)
        self.worker_waiting = Gauge("epd_worker_queue_depth", "Requests waiting on the worker", labels, registry=r)
        self.worker_kv_usage = Gauge("epd_worker_kv_usage_ratio", "KV blocks in use / all", labels, registry=r)
        self.worker_busy = Gauge("epd_worker_busy_ratio", "Share of the time between the worker's last two health "
                                 "answers that its engine worked (its utilization)", labels, registry=r)
        # counts kept elsewhere (a worker's, in its last health reply; the backend's moves), read at scrape
        self._encoder_counts: dict[tuple[str, str], tuple[int, int]] = {}
        self._moves: dict[str, int] = {}
        self._handoffs: dict[tuple[str, str], int] = {}
        counts = LiveCounters()
        counts.add_labelled("epd_encoder_forwards", "Encoder batches run (the worker's count)", labels,
                            lambda: ((k, v[0]) for k, v in self._encoder_counts.items()))
        counts.add_labelled("epd_encoder_encoded_items", "Items encoded, i.e. cache misses (the worker's count)",
                            labels, lambda: ((k, v[1]) for k, v in self._encoder_counts.items()))
        counts.add_labelled("epd_request_moves", "Requests moved off a lost worker since start, by stage "
                            "(redispatched: before the first token; migrated: mid-stream)", ["stage"],
                            lambda: (((stage,), self._moves.get(stage, 0)) for stage in ("redispatched", "migrated")))
        counts.add_labelled("epd_tensor_handoffs", "Tensor hand-overs the router arranged since start, by stage "
                            "(embeddings: encoder to prefill; kv: prefill to decode) and placement (same_host: "
                            "shm / CUDA IPC; cross_host: inline / NCCL; store: prefill read the rows from the "
                            "encoder cache store itself)", ["stage", "placement"],
                            lambda: self._handoffs.items())
        counts.add("epd_output_tokens", "Output tokens streamed", lambda: self.output_tokens)
        self._store_misses = 0
        counts.add("epd_router_store_read_misses", "Items sent to prefill to read from the encoder cache store that "
                   "it could not read there (evicted, damaged, the store down): encoded and pushed instead",
                   lambda: self._store_misses)
        r.register(counts)

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.recent_ttft.append((time.monotonic(), ttft_s))
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_tokens.inc(num_cached_tokens)

    def observe_error(self, err) -> None:
        """A request that ended in an ``EPDError``: by status, and by reason when admission refused it."""
        reason = _ADMISSION_REASONS.get(err.http_status)
        if reason:
            self.rejections.labels(reason).inc()
        self.requests.labels(f"error_{err.http_status}").inc()

    def observe_done(self, start_s: float, first_token_s: float | None, num_tokens: int) -> None:
        """A finished request; times from ``time.monotonic()`` (its tokens were counted as they streamed)."""
        end = time.monotonic()
        self.e2e.observe(end - start_s)
        if first_token_s is not None and num_tokens > 1:
            self.tpot.observe((end - first_token_s) / (num_tokens - 1))
        self.requests.labels("ok").inc()

    def refresh_cluster(self, workers) -> None:
        for states in workers.values():
            for w in states:
                key = (w.tier, w.address)
                self.worker_healthy.labels(*key).set(1 if w.healthy else 0)
                self.worker_running.labels(*key).set(w.last_health.num_running)
                self.worker_waiting.labels(*key).set(w.last_health.num_waiting)
                self.worker_kv_usage.labels(*key).set(w.last_health.kv_usage)
                if w.busy_fraction is not None:
                    self.worker_busy.labels(*key).set(w.busy_fraction)
        self._encoder_counts = {(w.tier, w.address): (w.last_health.num_encoder_forwards,
                                                     w.last_health.num_encoded_items)
                                for states in workers.values() for w in states if w.tier == "encoder"}

    def refresh_moves(self, moves) -> None:
        self._moves = dict(moves)

    def refresh_handoffs(self, handoffs, store_misses: int = 0) -> None:
        self._handoffs = dict(handoffs)
        self._store_misses = store_misses

    def render(self) -> bytes:
        return render(self.registry)
