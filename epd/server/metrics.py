"""Prometheus metrics of the worker tiers (prefix ``epd_``), served over HTTP on each worker's
``--metrics-port`` for Prometheus / the ServiceMonitor; live values are read at scrape time."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from epd.prometheus import LiveCounters, exposition

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class TierMetrics:
    def __init__(self, tier: str, model_name: str) -> None:
        self.tier = tier
        self.own = r = CollectorRegistry()
        self.counts = LiveCounters()
        r.register(self.counts)
        self.registry = exposition(r, model_name)  # what /metrics serves
        self.requests = Counter("epd_tier_requests", "Requests handled by this worker, by outcome", ["outcome"],
                                registry=r)
        self.transfer_bytes = Counter("epd_transfer_bytes", "Tensor bytes handed over, by transport and direction",
                                      ["transport", "direction"], registry=r)
        self.transfer_seconds = Histogram("epd_transfer_seconds", "Time to export or import one tensor",
                                          ["transport", "direction"], buckets=_SECONDS_BUCKETS, registry=r)

    def count_failure(self, err) -> None:
        """A request this worker refused or failed (an ``EPDError``): overloaded (its admission was
        full: the router retries), invalid (the request itself), or error."""
        status = err.code.http_status
        self.requests.labels("overloaded" if status == 429 else "invalid" if status < 500 else "error").inc()

    def live(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read at scrape time (queue depth, KV usage, open leases)."""
        Gauge(name, doc, registry=self.own).set_function(fn)

    @contextlib.contextmanager
    def time_transfer(self, transport: str, direction: str, nbytes: int) -> Iterator[None]:
        """Count the bytes and time the block: one export ("export") or import ("import") of a tensor."""
        start = time.perf_counter()
        yield
        self.transfer_bytes.labels(transport, direction).inc(nbytes)
        self.transfer_seconds.labels(transport, direction).observe(time.perf_counter() - start)

    def time_import(self, handle) -> contextlib.AbstractContextManager[None]:
        return self.time_transfer(handle.WhichOneof("body") or "none", "import", handle.nbytes)

    def store_reads(self) -> Counter:
        """Prefill: items whose rows it read from the cluster's encoder cache store (``store``
        handles), by outcome; their bytes and times are ``epd_transfer_*{transport="store"}``."""
        return Counter("epd_prefill_store_reads", "Items prefill read from the encoder cache store itself, by outcome: "
                       "read, or missed (not there or not readable: encoded and pushed instead)", ["outcome"],
                       registry=self.own)

    def watch_store(self, store) -> None:
        self.live("epd_open_leases", "Tensor leases this worker holds for consumers", lambda: store.num_open_leases)
        self.live("epd_open_lease_bytes", "Bytes held under open leases", lambda: store.open_bytes)
        self.counts.add_labelled("epd_lease_ends", "Tensor leases ended, by how: released by their consumer, expired "
                                 "(unrenewed past their TTL: a consumer that died or never released), closed (the "
                                 "worker stopped)", ["reason"],
                                 lambda: [((reason,), n) for reason, n in sorted(store.num_ended_by_reason.items())])

    def watch_engine(self, engine) -> None:
        sched, bm = engine.scheduler, engine.block_manager
        self.live("epd_queue_depth", "Requests waiting in the engine (for KV room, or to be imported)",
                  lambda: len(sched.waiting) + len(sched.importing))
        self.live("epd_running_requests", "Requests running in the engine", lambda: len(sched.running))
        self.live("epd_kv_block_usage_ratio", "KV blocks in use / all", lambda: bm.usage)
        self.live("epd_kv_blocks", "KV blocks in the paged cache", lambda: bm.num_total_blocks)
        self.counts.add("epd_engine_steps", "Engine steps run (a decode step: one token for every running request)",
                        lambda: engine.num_steps)
        self.counts.add("epd_engine_step_seconds", "Wall time the engine spent in its steps (its busy time: the "
                        "rate of this counter is the engine's utilization)", lambda: engine.step_seconds)
        self.counts.add("epd_engine_batch_steps", "Engine steps run from the decode batch kept from the step before "
                        "(no per-request scheduling or input reading)", lambda: engine.num_batch_steps)
        self.counts.add("epd_engine_overlapped_steps", "Engine steps launched while the step before still had its "
                        "tokens on the device (--async-scheduling)", lambda: engine.num_overlapped_steps)
        self.counts.add("epd_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                        lambda: bm.num_prefix_hit_tokens)
        self.counts.add("epd_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                        lambda: bm.num_prefix_query_tokens)

    def watch_encoder(self, engine) -> None:
        cache = engine.cache
        count = self.counts.add
        count("epd_encoder_cache_hits", "Encoder cache lookups that found the item", lambda: cache.metrics.hits)
        count("epd_encoder_cache_misses", "Encoder cache lookups that had to encode", lambda: cache.metrics.misses)
        count("epd_encoder_cache_evictions", "Encoder cache evictions", lambda: cache.metrics.evictions)
        count("epd_encoder_batches", "Encoder forwards (batches) run", lambda: engine.num_forwards)
        count("epd_encoder_batch_items", "Items encoded in all batches", lambda: engine.num_encoded_items)
        count("epd_encoder_busy_seconds", "Wall time the encoder's loop spent on its batches (its busy time: the "
              "rate of this counter is the encoder's utilization)", engine.busy.now)
        self.live("epd_encoder_cache_bytes", "Bytes in the encoder cache", lambda: cache.metrics.bytes)
        self.encoded_tokens = Counter("epd_encoder_tokens", "Encoder attention tokens of the items encoded "
                                      "(cache misses)", registry=self.own)
        self.live("epd_encoder_queue_depth", "Requests waiting for the encoder",
                  lambda: engine.scheduler.num_waiting_requests)
        if engine.shared_store is not None:
            self.watch_shared_store(engine.shared_store.stats)

    def watch_shared_store(self, stats) -> None:
        """The cluster's encoder cache store, as this encoder sees it (``SharedStoreStats``)."""
        count = self.counts.add
        count("epd_encoder_store_hits", "Items fetched from the cluster's encoder cache store instead of encoded",
              lambda: stats.hits)
        count("epd_encoder_store_misses", "Store lookups that found nothing", lambda: stats.misses)
        count("epd_encoder_store_puts", "Encoded items put in the store", lambda: stats.puts)
        count("epd_encoder_store_dropped_puts", "Encoded items not put: the put queue was full",
              lambda: stats.dropped_puts)
        count("epd_encoder_store_rejected", "Store entries rejected (corrupt, or not this encoder's dtype and "
              "shape) and encoded again", lambda: stats.rejected)
        count("epd_encoder_store_errors", "Store operations that failed (the encoder used its own cache)",
              lambda: stats.errors)
        count("epd_encoder_store_claims", "New items this encoder claimed, and so encoded for the cluster",
              lambda: stats.claims)
        count("epd_encoder_store_waits", "Items another encoder was encoding: waited for, not encoded here",
              lambda: stats.waits)
        count("epd_encoder_store_takeovers", "Claims taken over from a claimant whose lease ran out",
              lambda: stats.takeovers)
        self.live("epd_encoder_store_up", "1 while the last store operation succeeded, else 0",
                  lambda: 1.0 if stats.up else 0.0)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter; returns the bound port (0 picks a free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
