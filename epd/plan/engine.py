"""The discrete-event core of the cluster simulator: a clock, timed events, and devices whose
capacity the work running on them shares.

A device is processor sharing: the jobs running on it now split its capacity (a CPU host's cores, a
GPU's one) by what each asks for (a worker's threads), none faster than on its own. So three
single-threaded workers on two cores each run at two thirds of their own speed while all three are
busy, which is what this machine's EPD tiers do; a worker alone on a GPU runs at full speed.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

_DONE_MS = 1e-9


class Device:
    """``capacity``: cores (a CPU host) or 1 (a GPU); None: unlimited (every job at full speed)."""

    def __init__(self, name: str, capacity: float | None) -> None:
        self.name, self.capacity = name, capacity
        self._jobs: dict[int, list] = {}  # id -> [remaining ms, demand, on_done, owner]
        self._ids = itertools.count()
        self.busy_ms: dict[str, float] = {}  # owner -> ms it had work running (utilization)
        self.users = 0  # workers placed on it

    def start(self, work_ms: float, demand: float, owner: str, on_done: Callable[[], None]) -> None:
        self._jobs[next(self._ids)] = [max(work_ms, 0.0), demand, on_done, owner]

    @property
    def running(self) -> bool:
        return bool(self._jobs)

    def _rate(self) -> float:
        demand = sum(job[1] for job in self._jobs.values())
        return 1.0 if self.capacity is None or demand <= self.capacity else self.capacity / demand

    def next_done_in_ms(self) -> float:
        if not self._jobs:
            return float("inf")
        return min(job[0] for job in self._jobs.values()) / self._rate()

    def advance(self, elapsed_ms: float) -> None:
        if not self._jobs or elapsed_ms <= 0:
            return
        rate = self._rate()
        for job in self._jobs.values():
            job[0] -= elapsed_ms * rate
        for owner in {job[3] for job in self._jobs.values()}:
            self.busy_ms[owner] = self.busy_ms.get(owner, 0.0) + elapsed_ms

    def finished(self) -> list[Callable[[], None]]:
        done = [key for key, job in self._jobs.items() if job[0] <= _DONE_MS]
        return [self._jobs.pop(key)[2] for key in done]


class Clock:
    """Timed events and the devices' work, in time order (milliseconds)."""

    def __init__(self, devices: list[Device]) -> None:
        self.now_ms = 0.0
        self.last_work_ms = 0.0  # when a device last finished a job
        self.devices = devices
        self._events: list = []
        self._seq = itertools.count()

    def at(self, time_ms: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(time_ms, self.now_ms), next(self._seq), fn))

    def idle_ms(self) -> float:
        """How long no device has had work (0 while one has)."""
        if any(device.running for device in self.devices):
            return 0.0
        return self.now_ms - self.last_work_ms

    def after(self, delay_ms: float, fn: Callable[[], None]) -> None:
        self.at(self.now_ms + delay_ms, fn)

    def run(self, until_ms: float = float("inf"), max_events: int = 50_000_000) -> None:
        for _ in range(max_events):
            next_event = self._events[0][0] if self._events else float("inf")
            next_done = self.now_ms + min((d.next_done_in_ms() for d in self.devices), default=float("inf"))
            t = min(next_event, next_done)
            if t == float("inf") or t > until_ms:
                return
            for device in self.devices:
                device.advance(t - self.now_ms)
            self.now_ms = t
            callbacks = [fn for device in self.devices for fn in device.finished()]
            if callbacks:
                self.last_work_ms = t
            else:
                callbacks = [heapq.heappop(self._events)[2]]
            for fn in callbacks:
                fn()
        raise RuntimeError(f"the simulation did not end within {max_events} events")
