"""The online planner: how many workers each tier should have now, within a worker budget.

Every ``interval_s`` the router hands it what each tier looks like (``TierLoad``: workers in
rotation, requests waiting at them, requests they run, and the share of the time their engines
worked) and, optionally, how the latest first tokens did against a TTFT objective. A tier is
**hot** when its requests wait: more than ``queue_per_worker`` waiting per worker for ``up_after``
intervals in a row (or, with a TTFT objective missed, the tier where requests wait most). A tier is
**idle** when nothing waits at it, its workers run less than ``idle_running_per_worker`` each and
their engines worked less than ``idle_busy`` of the time (where they count it), for ``down_after``
intervals in a row (a TTFT objective: missed for ``up_after``). The requests counted at one instant
miss work that comes and goes between two looks (an encoder's batches, a prefill's chunks); the
busy share sums all of it, so a tier that is busy half the time is not taken for idle. Then:

- a tier under its minimum (``min_workers``: it was started with fewer, but not none) gets a worker
  first;
- a hot tier gets a worker when the budget has room; when it has none, the idlest idle tier above
  its minimum (the least busy) gives one up (a move: decode to encode when the load turns from text
  to images);
- an idle tier above its minimum gives a worker back when nothing is hot;
- after a decision, nothing more until the launcher has carried it out (the workers in rotation
  are what was asked) and ``cooldown_s`` has passed, and the signals count again from then: the
  next decision is made on the new split's load (hysteresis against flapping).

The planner only decides; a launcher carries it out (``epd serve``: starts a worker and registers
it, or drains one and stops it; on Kubernetes the desired counts are metrics an autoscaler reads).
Each decision comes with the reason, in words.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

TIERS = ("encoder", "prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    budget_workers: int  # encoders + prefills + decodes, at most
    min_workers: int = 1  # per tier
    interval_s: float = 1.0
    queue_per_worker: float = 2.0  # waiting requests per worker above which a tier is hot
    idle_running_per_worker: float = 0.5  # running requests per worker below which (nothing waiting) it is idle
    idle_busy: float = 0.3  # share of the time its engines worked below which (and the above) it is idle
    up_after: int = 3  # intervals in a row
    down_after: int = 10
    cooldown_s: float = 10.0
    ttft_slo_s: float | None = None  # TTFT objective: p90 of the latest first tokens

    def __post_init__(self) -> None:
        if self.budget_workers < 3 * self.min_workers:
            raise ValueError(f"autoscale budget of {self.budget_workers} workers cannot give each of the 3 tiers its "
                             f"minimum of {self.min_workers}")
        for name in ("interval_s", "queue_per_worker", "cooldown_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"autoscale {name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.idle_busy <= 1:
            raise ValueError(f"autoscale idle_busy is a share of the time, in (0, 1]; got {self.idle_busy}")
        if self.up_after < 1 or self.down_after < 1:
            raise ValueError(f"autoscale up_after and down_after must be >= 1, got {self.up_after}, {self.down_after}")


@dataclass(frozen=True)
class TierLoad:
    workers: int  # in rotation
    waiting: int  # requests waiting at them (their queues)
    running: int  # requests they run
    busy: float | None = None  # the mean share of the last interval that their engines worked (None: not counted)

    @property
    def waiting_per_worker(self) -> float:
        return self.waiting / max(self.workers, 1)

    @property
    def running_per_worker(self) -> float:
        return self.running / max(self.workers, 1)

    def quiet(self) -> tuple[float, float]:
        """A key for the least loaded: busy share first, then requests running per worker."""
        return (0.0 if self.busy is None else self.busy, self.running_per_worker)

    def describe_quiet(self) -> str:
        """In words, why it looks quiet (for a decision's reason)."""
        busy = "" if self.busy is None else f", busy {100 * self.busy:.0f}%"
        return f"nothing waiting, {self.running_per_worker:.1f} running per worker{busy}"


@dataclass(frozen=True)
class Decision:
    at_s: float
    desired: dict[str, int]
    reason: str

    def as_dict(self) -> dict:
        return {"at_s": round(self.at_s, 3), "desired": dict(self.desired), "reason": self.reason}


@dataclass
class Planner:
    config: AutoscaleConfig
    desired: dict[str, int]  # what the launcher is asked for (the counts it started with, at first)
    log: deque = field(default_factory=lambda: deque(maxlen=100))  # the latest decisions, oldest first
    _hot: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # intervals in a row
    _idle: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    _missed: int = 0  # intervals in a row the TTFT objective was missed
    _last_decision_s: float | None = None

    def observe(self, now_s: float, loads: dict[str, TierLoad], ttft_p90_s: float | None = None) -> Decision | None:
        """One interval's look at the tiers -> a decision (``desired`` changed), or None."""
        cfg = self.config
        for tier in TIERS:
            load = loads[tier]
            hot = load.waiting_per_worker > cfg.queue_per_worker
            idle = (load.waiting == 0 and load.running_per_worker < cfg.idle_running_per_worker
                    and (load.busy is None or load.busy < cfg.idle_busy))
            self._hot[tier] = self._hot[tier] + 1 if hot else 0
            self._idle[tier] = self._idle[tier] + 1 if idle else 0
        missed = cfg.ttft_slo_s is not None and ttft_p90_s is not None and ttft_p90_s > cfg.ttft_slo_s
        self._missed = self._missed + 1 if missed else 0
        if not self._settled(now_s, loads):  # what is seen meanwhile is the old split's: it does not count
            self._hot, self._idle, self._missed = dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0), 0
            return None
        # started below the floor (a tier started with none, e.g. no encoders for text only, stays so)
        if short := [t for t in TIERS if 0 < self.desired[t] < cfg.min_workers]:
            return self._to_floor(now_s, short[0])
        hot = [t for t in TIERS if self._hot[t] >= cfg.up_after]
        slo_missed = self._missed >= cfg.up_after
        if not hot and slo_missed:  # the objective is missed: the tier where requests wait most, if any wait
            waiting = max(TIERS, key=lambda t: loads[t].waiting_per_worker)
            if loads[waiting].waiting > 0:
                hot = [waiting]
        idle = [t for t in TIERS if self._idle[t] >= cfg.down_after and self.desired[t] > cfg.min_workers]
        if hot:
            return self._grow(now_s, max(hot, key=lambda t: loads[t].waiting_per_worker), loads, idle, slo_missed,
                              ttft_p90_s)
        if idle:
            tier = min(idle, key=lambda t: loads[t].quiet())
            return self._decide(now_s, {tier: -1}, f"{tier} idle for {self._idle[tier]} intervals "
                                                   f"({loads[tier].describe_quiet()}): one worker back to the budget")
        return None

    def _settled(self, now_s: float, loads: dict[str, TierLoad]) -> bool:
        """The last decision is carried out (the workers in rotation are those asked for) and its
        cool-down has passed."""
        if self._last_decision_s is None:
            return True
        carried_out = all(loads[t].workers == self.desired[t] for t in TIERS)
        return carried_out and now_s - self._last_decision_s >= self.config.cooldown_s

    def _grow(self, now_s: float, tier: str, loads: dict[str, TierLoad], idle: list[str], slo_missed: bool,
              ttft_p90_s: float | None) -> Decision | None:
        load = loads[tier]
        why = (f"{tier} hot for {self._hot[tier]} intervals ({load.waiting_per_worker:.1f} waiting per worker, "
               f"above {self.config.queue_per_worker:g})")
        if slo_missed:
            why += f"; TTFT p90 {ttft_p90_s:.2f} s over the objective {self.config.ttft_slo_s:g} s"
        if sum(self.desired.values()) < self.config.budget_workers:
            return self._decide(now_s, {tier: +1}, f"{why}: one more {tier} worker (budget "
                                                   f"{sum(self.desired.values()) + 1} of {self.config.budget_workers})")
        donors = [t for t in idle if t != tier] or [
            t for t in TIERS if t != tier and self.desired[t] > self.config.min_workers
            and loads[t].waiting == 0 and self._hot[t] == 0 and self._idle[t] > 0]
        if not donors:
            return None  # the budget is spent and every other tier is busy: nothing to move
        donor = min(donors, key=lambda t: loads[t].quiet())
        return self._decide(now_s, {tier: +1, donor: -1},
                            f"{why}; the budget of {self.config.budget_workers} is spent: a {donor} worker moves to "
                            f"{tier} ({donor}: {loads[donor].describe_quiet()})")

    def _to_floor(self, now_s: float, tier: str) -> Decision:
        """A tier under its minimum gets a worker: from the budget, else from the tier most above its
        own (the budget keeps every tier's minimum: checked at start)."""
        why = f"{tier} has {self.desired[tier]} worker(s), under its minimum of {self.config.min_workers}"
        if sum(self.desired.values()) < self.config.budget_workers:
            return self._decide(now_s, {tier: +1}, f"{why}: one more {tier} worker (budget "
                                                   f"{sum(self.desired.values()) + 1} of {self.config.budget_workers})")
        donor = max((t for t in TIERS if t != tier), key=lambda t: self.desired[t])
        return self._decide(now_s, {tier: +1, donor: -1}, f"{why}; the budget of {self.config.budget_workers} is "
                                                         f"spent: a {donor} worker moves to {tier}")

    def _decide(self, now_s: float, change: dict[str, int], reason: str) -> Decision:
        self.desired = {t: self.desired[t] + change.get(t, 0) for t in TIERS}
        self._last_decision_s = now_s
        decision = Decision(now_s, dict(self.desired), reason)
        self.log.append(decision)
        return decision
