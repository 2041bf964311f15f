"""What each stage costs, read from an ``epd profile`` JSON: the cluster simulator's only source of
time. Between the points measured, costs are interpolated linearly; past them, extrapolated along the
last two points (never below zero), so a profile of a few points covers a workload's range.

Every cost is milliseconds of one worker's own time at the profile's thread count (``threads``):
what the worker spends when it has that many cores to itself.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (x, y), extended along the outer segments; >= 0."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no points to interpolate")
    if len(pts) == 1:
        return max(0.0, pts[0][1])
    xs = [p[0] for p in pts]
    i = min(max(bisect.bisect_left(xs, x), 1), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    if x1 == x0:
        return max(0.0, y1)
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _grid(points: list[tuple[float, float, float]], x: float, y: float) -> float:
    """Bilinear-ish: along y at each measured x, then along x."""
    by_x: dict[float, list[tuple[float, float]]] = {}
    for px, py, value in points:
        by_x.setdefault(px, []).append((py, value))
    return interpolate([(px, interpolate(col, y)) for px, col in by_x.items()], x)


@dataclass(frozen=True)
class StageCosts:
    model: str
    device: str
    threads: int
    encoder: tuple[tuple[float, float, float], ...]  # (image pixels, batch, ms per item)
    prefill_cold: tuple[tuple[float, float], ...]  # (prompt tokens, ms)
    prefill_cached: tuple[tuple[float, float], ...]  # (prompt tokens, ms) with all but the last block cached
    decode: tuple[tuple[float, float, float], ...]  # (batch, context tokens, ms per step), greedy
    transfer: dict  # transport -> ((MB, ms per MB), ...)
    chunk_tokens: int = 2048
    router: tuple[tuple[float, float], ...] = ()  # (image pixels, ms per request before dispatch)
    wake_step: tuple[tuple[float, float], ...] = ()  # (idle ms, extra ms of an engine's first step after it)
    wake_python: tuple[tuple[float, float], ...] = ()  # (idle ms, extra ms of the router's first work)
    pipeline: dict | None = None  # "epd" / "aggregated" -> request_ms, image_ms, step_ms (the serving path's own)
    shapes: dict | None = None  # row_bytes (one embedding row), kv_bytes_per_token
    decode_sampled: tuple[tuple[float, float, float], ...] = ()  # the same, every row sampled (temperature 1)

    @classmethod
    def from_profile(cls, profile: dict | str | Path) -> StageCosts:
        if not isinstance(profile, dict):
            profile = json.loads(Path(profile).read_text())
        try:
            prefill = profile["prefill"]
            return cls(
                model=profile.get("model", "?"), device=profile.get("device", "?"),
                threads=int(profile.get("host", {}).get("threads", 1)),
                encoder=tuple((p["image_px"] ** 2, p["batch"], p["ms_per_item"]) for p in profile["encoder"]),
                prefill_cold=tuple((p["prompt_tokens"], p["ms_total"]) for p in prefill if not p["prefix_cached"]),
                prefill_cached=tuple((p["prompt_tokens"], p["ms_total"]) for p in prefill if p["prefix_cached"]),
                decode=tuple((p["batch"], p["context_tokens"], p["ms_per_step"]) for p in profile["decode"]
                             if not p.get("temperature")),
                decode_sampled=tuple((p["batch"], p["context_tokens"], p["ms_per_step"]) for p in profile["decode"]
                                     if p.get("temperature")),
                transfer={t: tuple((p["mb"], p["ms_per_mb"]) for p in profile["transfer"] if p["transport"] == t)
                          for t in {p["transport"] for p in profile["transfer"]}},
                chunk_tokens=max((p.get("chunk_tokens", 2048) for p in prefill), default=2048),
                router=tuple((p["image_px"] ** 2, p["ms_per_request"]) for p in profile.get("router", ())),
                wake_step=tuple((1000 * p["idle_s"], p["step_extra_ms"]) for p in profile.get("wake", ())),
                wake_python=tuple((1000 * p["idle_s"], p["python_extra_ms"]) for p in profile.get("wake", ())),
                pipeline=profile.get("pipeline"), shapes=profile.get("shapes"))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not an epd profile (missing or malformed {err})") from None

    def encoder_ms(self, pixels: float, batch: int) -> float:
        """One item of ``pixels`` (width x height) in a batch of ``batch``: ms of the encoder."""
        return _grid([(px, b, ms) for px, b, ms in self.encoder], pixels, batch)

    def prefill_ms(self, tokens: int, cached_tokens: int = 0) -> float:
        """A prompt of ``tokens`` to its first token, ``cached_tokens`` of them from the prefix cache."""
        cold = interpolate(list(self.prefill_cold), tokens)
        if not cached_tokens or not self.prefill_cached:
            return cold
        floor = interpolate(list(self.prefill_cached), tokens)  # the last block's compute and the step
        return max(floor, cold * (tokens - cached_tokens) / max(tokens, 1))

    def decode_ms(self, batch: int, context_tokens: float, sampled: bool = False) -> float:
        """One decode step of ``batch`` sequences of ``context_tokens`` (mean) each, greedy or
        ``sampled`` (the greedy figures where the profile has no sampled ones)."""
        points = self.decode_sampled if sampled and self.decode_sampled else self.decode
        # below the shortest context measured, that one's cost: a step costs no less at a longer
        # context, and a slope between two noisy points would make a shorter one cost more
        shortest = min(c for _, c, _ in points)
        return _grid(list(points), batch, max(context_tokens, shortest))

    def served_step_ms(self, batch: int, context_tokens: float, sampled: bool = False) -> float:
        """A decode step in a decode worker: the profile's in-process step, scaled by how the worker's
        own engine stepped while ``epd profile --pipeline`` ran requests through it (its
        ``engine_ms_per_step`` figures, ``engine_scale``); a profile without them: its step as it is."""
        measured = self._path(False).get("measured", {})
        # the run's requests were sampled (as a bench's are): the ratio is to the sampled steps
        scale = engine_scale(self, batch, True, measured.get("engine_ms_per_step"),
                             measured.get(f"engine_ms_per_step_{ENGINE_CROWD}_streams"))
        return self.decode_ms(batch, context_tokens, sampled) * scale

    def router_ms(self, pixels: float, default_ms: float) -> float:
        """The router's work on a request with ``pixels`` of images before dispatch (the profile's,
        or ``default_ms`` for a profile without router points)."""
        return interpolate(list(self.router), pixels) if self.router else default_ms

    def wake_ms(self, idle_ms: float, engine: bool = True) -> float:
        """The extra ms a worker's (``engine``) or the router's first work costs after idling
        ``idle_ms``: none without the profile's points, none for no idling, never more than the
        longest idle measured did."""
        points = self.wake_step if engine else self.wake_python
        if not points or idle_ms <= 0:
            return 0.0
        longest = max(points)
        return interpolate([(0.0, 0.0), *points], min(idle_ms, longest[0]))

    def path_wake_ms(self, aggregated: bool, idle_ms: float, with_images: bool) -> float | None:
        """How much longer a request's first token takes when it finds the cluster idle ``idle_ms``
        (measured end to end by ``epd profile --pipeline``); None when the profile has no such points."""
        points = self._path(aggregated).get("wake")
        if not points:
            return None
        curve = [(1000 * p["idle_s"], p["image_ms" if with_images else "text_ms"]) for p in points]
        return interpolate([(0.0, 0.0), *curve], min(max(idle_ms, 0.0), max(curve)[0]))

    def _path(self, aggregated: bool) -> dict:
        """``epd profile --pipeline``'s figures for one serving path ({} without them)."""
        return (self.pipeline or {}).get("aggregated" if aggregated else "epd", {})

    def path_ms(self, aggregated: bool, what: str) -> float:
        """The serving path's own ``request_ms``, ``image_ms``, ``step_ms``, ``handoff_ms`` or
        ``encoder_batch_ms`` (0 without them)."""
        return self._path(aggregated).get(what, 0.0)

    def cpu_beyond_ms(self, aggregated: bool, part: str, what: str, in_flight: float = 1.0) -> float:
        """The CPU beyond every cost above (``epd profile --pipeline``'s counters) that ``part``
        spends per ``request_ms``, ``image_ms`` or ``token_ms``: "router" (its loop's, which requests
        wait for), "background" (the other processes', beside the requests) or "client"; 0 without
        the figures. Where it was measured at several loads (``points``: a paced stream, requests at
        once), at ``in_flight`` requests running together, along the line between them and no
        further than the loads measured: requests that overlap share a step's message and their
        processes' wake-ups, so each costs less."""
        figures = self._path(aggregated).get(part, {})
        points = figures.get("points")
        if not points:
            return figures.get(what, 0.0)
        loads = [p["in_flight"] for p in points]
        at = min(max(in_flight, min(loads)), max(loads))
        return interpolate([(p["in_flight"], p[what]) for p in points], at)

    def host_cpu_ms(self, aggregated: bool, what: str, with_client: bool, in_flight: float = 1.0) -> float:
        """The CPU beside the requests per request, image or token: the processes' other than the
        router's, with the client's own when it runs on the same host (``in_flight``: as above)."""
        parts = ("background", "client") if with_client else ("background",)
        return sum(self.cpu_beyond_ms(aggregated, part, what, in_flight) for part in parts)

    @property
    def local_transport(self) -> str:
        """How tiers on one host hand tensors over here: CUDA IPC where measured, else shared memory."""
        for name in ("cuda_ipc", "shm"):
            if name in self.transfer:
                return name
        return sorted(self.transfer)[0]

    def transfer_ms(self, transport: str, nbytes: float) -> float:
        """Handing ``nbytes`` over by ``transport`` (export and import)."""
        points = self.transfer.get(transport)
        if not points:
            raise ValueError(f"the profile has no {transport} transfers (it has {sorted(self.transfer)})")
        mb = nbytes / 2**20
        return mb * interpolate(list(points), mb)


ENGINE_CROWD = 4  # the streams at once whose engine steps ``epd profile --pipeline`` reads (besides one)


def engine_scale(costs: StageCosts, batch: int, sampled: bool, alone_ms: float | None,
                 crowded_ms: float | None) -> float:
    """How much longer a decode worker's engine steps than the profile's in-process engine, at
    ``batch``: its steps at batch 1 (``alone_ms``) and ``ENGINE_CROWD`` (``crowded_ms``) read while
    requests ran through it, against the profile's at the shortest context measured, along the line
    between them (at most ``ENGINE_CROWD``), never below 1. A worker's engine also takes the KV it
    imports and hands each step's tokens on, which a step in one process does not. 1 without them."""
    if not alone_ms or not crowded_ms:
        return 1.0
    points = costs.decode_sampled if sampled and costs.decode_sampled else costs.decode
    shortest = min(c for _, c, _ in points)
    ratios = [(b, ms / costs.decode_ms(b, shortest, sampled)) for b, ms in ((1, alone_ms), (ENGINE_CROWD, crowded_ms))]
    return max(interpolate(ratios, min(max(batch, 1), ENGINE_CROWD)), 1.0)
