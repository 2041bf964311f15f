"""The router's side of the online planner (``epd.plan.autoscale``): every ``autoscale_interval_s``
it reads each tier's load from the workers' health answers (requests waiting at them, requests they
run, and the share of the time their engines worked between two answers), and the TTFT p90 of the
last 30 s, and lets the planner decide. What it wants is the
``epd_planner_desired_workers{tier}`` gauge (what an autoscaler on Kubernetes reads), the admin
API's ``GET /admin/plan`` (what ``epd serve`` reads, and carries out through the admin API's
register and drain), and a log line per decision saying why."""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter, Gauge

from epd.plan.autoscale import TIERS, AutoscaleConfig, Planner, TierLoad

log = logging.getLogger("epd.router")
_TTFT_WINDOW_S = 30.0


class PlannerLoop:
    def __init__(self, config, workers, metrics) -> None:
        """``config``: the RouterConfig; ``workers``: the backend's ``WorkerRegistry``; ``metrics``:
        the ``RouterMetrics`` (its registry gets the planner's gauges, its recent TTFTs are read)."""
        counts = {tier: len(states) for tier, states in workers.workers.items()}  # as started
        self.planner = Planner(AutoscaleConfig(budget_workers=config.autoscale_budget,
                                               min_workers=config.autoscale_min_workers,
                                               interval_s=config.autoscale_interval_s,
                                               cooldown_s=config.autoscale_cooldown_s,
                                               ttft_slo_s=config.autoscale_ttft_slo_s),
                               {tier: counts.get(tier, 0) for tier in TIERS})
        self.workers, self.metrics = workers, metrics
        self.last_loads: dict[str, TierLoad] = {}  # what the last look saw (GET /admin/plan shows it)
        self.desired = Gauge("epd_planner_desired_workers", "Workers the planner wants per tier (its launcher "
                             "carries it out)", ["tier"], registry=metrics.own)
        self.decisions = Counter("epd_planner_decisions", "Decisions of the planner", registry=metrics.own)
        self._show()

    def loads(self) -> dict[str, TierLoad]:
        loads = {}
        for tier in TIERS:
            states = [w for w in self.workers.workers.get(tier, []) if w.healthy and not w.draining and not w.stopping]
            # a prefill request waiting for its rows waits on the encoders, not on prefill
            busy = [w.busy_fraction for w in states if w.busy_fraction is not None]
            loads[tier] = TierLoad(len(states), sum(w.last_health.num_waiting - w.last_health.num_waiting_on_inputs
                                                    for w in states),
                                   sum(w.last_health.num_running for w in states),
                                   sum(busy) / len(busy) if busy else None)
        return loads

    def ttft_p90_s(self, now_s: float) -> float | None:
        recent = sorted(ttft for at, ttft in self.metrics.recent_ttft if now_s - at <= _TTFT_WINDOW_S)
        return recent[int(0.9 * (len(recent) - 1))] if recent else None

    def step(self, now_s: float) -> None:
        self.last_loads = self.loads()
        decision = self.planner.observe(now_s, self.last_loads, self.ttft_p90_s(now_s))
        if decision is not None:
            self.decisions.inc()
            self._show()
            log.info("planner: %s -> %s", decision.reason,
                     ", ".join(f"{n} {tier}(s)" for tier, n in decision.desired.items()))

    def _show(self) -> None:
        for tier, n in self.planner.desired.items():
            self.desired.labels(tier).set(n)

    def as_dict(self) -> dict:
        return {"desired": dict(self.planner.desired), "budget": self.planner.config.budget_workers,
                "tiers": {tier: {"workers": load.workers, "waiting": load.waiting, "running": load.running,
                                 **({"busy": round(load.busy, 3)} if load.busy is not None else {})}
                          for tier, load in self.last_loads.items()},
                "decisions": [d.as_dict() for d in self.planner.log]}

    async def run(self) -> None:
        interval_s = self.planner.config.interval_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.step(time.monotonic())
            except Exception:  # noqa: BLE001 - a bad look must not end the planner
                log.exception("planner: this look failed; trying again next interval")
