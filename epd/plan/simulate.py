"""The cluster simulator: a profile (``epd profile``), a topology and a workload in; TTFT / TPOT /
end-to-end distributions, goodput under an SLO and each tier's utilization out.

    from epd.plan.simulate import Topology, simulate, requests_from_workload
    result = simulate(StageCosts.from_profile("profile.json"), Topology(encoders=2, cores=16), requests)

A topology is the E:P:D split (or ``aggregated``: one engine process), tensor-parallel sizes, and
where the workers run: ``cores`` shared by all of them on one CPU host (what this machine does),
or one device each (GPUs; ``workers_per_device`` > 1 puts several on one). The router is dispatched
as EPD's is: prefill and decode by load, each image to the encoder its identity hashes to (so a
repeat finds its cache there).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import zlib
from dataclasses import dataclass, field

from epd.plan.costs import StageCosts
from epd.plan.engine import Clock, Device
from epd.plan.tiers import Aggregated, Decode, Encoder, Prefill, Router, SimRequest, SimSettings

TEMPLATE_TOKENS = 20  # a one-turn chat's template around the text (Qwen's)
IMAGE_MARK_TOKENS = 2  # vision start and end around an image's placeholders


@dataclass(frozen=True)
class Topology:
    encoders: int = 1
    prefills: int = 1
    decodes: int = 1
    aggregated: bool = False  # one engine process (--aggregated), the E/P/D counts unused
    prefill_tp: int = 1
    decode_tp: int = 1
    cores: float | None = None  # one CPU host of this many cores shared by every process; None: devices
    workers_per_device: int = 1  # with devices: workers sharing one (GPU sharing)
    threads: float = 1.0  # each worker's compute threads on a CPU host (what the profile measured)

    @property
    def devices(self) -> int:
        """Devices this topology occupies (GPUs; a CPU host counts as one)."""
        if self.cores is not None:
            return 1
        if self.aggregated:
            return 1
        ranks = self.encoders + self.prefills * self.prefill_tp + self.decodes * self.decode_tp
        return math.ceil(ranks / self.workers_per_device)

    def label(self) -> str:
        if self.aggregated:
            return "aggregated"
        tp = "" if self.prefill_tp == self.decode_tp == 1 else f" (TP {self.prefill_tp}/{self.decode_tp})"
        return f"{self.encoders}E{self.prefills}P{self.decodes}D{tp}"


@dataclass
class SimResult:
    requests: list[SimRequest]
    duration_ms: float
    utilization: dict[str, float] = field(default_factory=dict)  # tier -> busy share of its workers' time

    def percentile_ms(self, what: str, q: float) -> float | None:
        values = sorted(v for r in self.requests if (v := getattr(r, f"{what}_ms")) is not None)
        if not values:
            return None
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]

    def goodput(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> float:
        """Requests per second that met both SLOs."""
        ok = [r for r in self.requests if (slo_ttft_ms is None or r.ttft_ms <= slo_ttft_ms)
              and (slo_tpot_ms is None or r.tpot_ms is None or r.tpot_ms <= slo_tpot_ms)]
        return 1000.0 * len(ok) / self.duration_ms if self.duration_ms else 0.0

    def attainment(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> float:
        return self.goodput(slo_ttft_ms, slo_tpot_ms) * self.duration_ms / 1000.0 / max(len(self.requests), 1)

    def summary(self) -> dict:
        return {"requests": len(self.requests), "duration_s": round(self.duration_ms / 1000, 3),
                **{f"{what}_p{q}_ms": self.percentile_ms(what, q) for what in ("ttft", "tpot", "e2e") for q in (50, 90)},
                "utilization": {k: round(v, 3) for k, v in self.utilization.items()}}


def simulate(costs: StageCosts, topology: Topology, requests: list[SimRequest],
             settings: SimSettings = SimSettings()) -> SimResult:
    """Run ``requests`` (fresh ones: they are filled in) through ``topology``; -> what each got."""
    shapes = costs.shapes or {}
    settings = dataclasses.replace(
        settings, transport=settings.transport or costs.local_transport,
        row_bytes=settings.row_bytes or shapes.get("row_bytes", 4 * 1536),
        kv_bytes_per_token=settings.kv_bytes_per_token or shapes.get("kv_bytes_per_token", 4 * 2 * 28 * 512))
    host = Device("host", topology.cores)  # the router's, and on a CPU host every worker's
    devices = [host]

    def device_for(name: str) -> Device:
        if topology.cores is not None:
            return host
        if not devices[-1].name.startswith("gpu") or devices[-1].users >= topology.workers_per_device:
            devices.append(Device(f"gpu{len(devices) - 1}", 1.0))
        devices[-1].users += 1
        return devices[-1]

    clock = Clock(devices)
    router = Router(clock, host, costs, settings, aggregated=topology.aggregated)
    done: list[SimRequest] = []

    def finished(request: SimRequest) -> None:  # its last token: it leaves the cluster's count
        done.append(request)
        router.in_flight -= 1
    demand = topology.threads if topology.cores is not None else 1.0

    def worker(cls, name: str, tp: int = 1, **kwargs):
        speedup = 1.0 if tp == 1 else tp * settings.tp_efficiency
        return cls(name, clock, device_for(name), costs, settings, threads=demand, speedup=speedup, **kwargs)

    if topology.aggregated:
        engine = worker(Aggregated, "aggregated", router=router, on_finished=finished)
        router.shares_lock_with = engine
        dispatch = engine.add
        workers = [engine]
    else:
        decodes = [worker(Decode, f"decode{i}", topology.decode_tp, router=router, on_finished=finished)
                   for i in range(topology.decodes)]

        def first_token(prefill: Prefill, request: SimRequest) -> None:
            router.tokens([request])
            request.context, request.produced = request.prompt_tokens, 1
            if request.produced >= request.output_tokens:
                finished(request)
                return
            decode = min(decodes, key=lambda d: d.load)
            # the KV's transfer, and what the hand-off costs beyond it (the profile's, measured end to end)
            delay_ms = (costs.transfer_ms(settings.transport, request.prompt_tokens * settings.kv_bytes_per_token)
                        + costs.path_ms(False, "handoff_ms"))
            decode.load += 1  # counted from the hand-off, as the router counts it
            clock.after(delay_ms, lambda: (setattr(decode, "load", decode.load - 1), decode.add(request)))

        prefills = [worker(Prefill, f"prefill{i}", topology.prefill_tp, on_first_token=first_token)
                    for i in range(topology.prefills)]
        encoders = [worker(Encoder, f"encoder{i}") for i in range(topology.encoders)]

        def dispatch(request: SimRequest) -> None:
            if request.images and not encoders:
                raise ValueError(f"{topology.label()} has no encoder for a request with images")
            prefill = min(prefills, key=lambda p: p.load)
            prefill.register(request)
            for identity, pixels, rows in request.images:
                encoder = max(encoders, key=lambda e: zlib.crc32(f"{identity}/{e.name}".encode()))
                encoder.submit(identity, pixels, rows, lambda rows, p=prefill, r=request: p.rows_arrived(r, rows))
        workers = [*encoders, *prefills, *decodes]

    cold = costs.path_wake_ms(topology.aggregated, 0.0, False) is not None  # measured end to end: per request

    def arrive(request: SimRequest) -> None:
        router.in_flight += 1
        load, aggregated, images = router.in_flight, topology.aggregated, len(request.images)
        work_ms = (costs.router_ms(sum(pixels for _, pixels, _ in request.images), settings.router_ms_per_request)
                   + costs.cpu_beyond_ms(aggregated, "router", "request_ms", load)
                   + images * costs.cpu_beyond_ms(aggregated, "router", "image_ms", load))
        router.background(costs.host_cpu_ms(aggregated, "request_ms", settings.client_on_host, load)
                          + images * costs.host_cpu_ms(aggregated, "image_ms", settings.client_on_host, load))
        # the hops' own time (no one's CPU), longer when the request finds the cluster cold
        path_ms = costs.path_ms(topology.aggregated, "request_ms")
        if cold:
            path_ms += costs.path_wake_ms(topology.aggregated, clock.idle_ms(), bool(request.images))
        router.handle(work_ms, lambda: clock.after(path_ms, lambda: dispatch(request)))

    for worker_ in workers:
        worker_.wakes = not cold  # without end-to-end wake figures, each process's own (the profile's "wake")
    router.wakes = not cold
    for request in requests:
        clock.at(request.arrival_ms, lambda r=request: arrive(r))
    clock.run()
    if len(done) != len(requests):
        raise RuntimeError(f"{len(requests) - len(done)} simulated requests never finished")
    duration_ms = max(r.token_ms[-1] for r in requests) - min(r.arrival_ms for r in requests)
    busy: dict[str, list[float]] = {}
    for w in workers:
        busy.setdefault(w.tier, []).append(w.device.busy_ms.get(w.name, 0.0) / duration_ms if duration_ms else 0.0)
    return SimResult(requests, duration_ms, {tier: statistics.fmean(v) for tier, v in busy.items()})


def image_rows(width: int, height: int, patch_px: int = 28, max_pixels: int = 12_845_056) -> int:
    """Embedding rows of an image (Qwen2-VL's resize: sides to multiples of ``patch_px``, area capped)."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    return max(1, round(height * scale / patch_px)) * max(1, round(width * scale / patch_px))


def requests_from_workload(workload, rate: float, burstiness: float = 1.0, *, run_index: int = 0,
                           patch_px: int = 28) -> list[SimRequest]:
    """The requests ``epd bench`` sends for ``workload`` (an ``epd.bench.workload.WorkloadConfig``)
    at ``rate``: the same arrivals, lengths, image sizes and repeats (same seed), none rendered."""
    from epd.bench.workload import build_workload

    out = []
    for spec in build_workload(workload, rate, burstiness, run_index=run_index):
        images = tuple((zlib.crc32(repr(im.key).encode()), im.width * im.height,
                        image_rows(im.width, im.height, patch_px))
                       for im in spec.images)
        tokens = (len(spec.prompt.split()) + TEMPLATE_TOKENS
                  + sum(rows + IMAGE_MARK_TOKENS for _, _, rows in images))
        out.append(SimRequest(spec.index, 1000.0 * spec.arrival_s, tokens, spec.output_len, images))
    return out
