"""How long an engine has worked: its busy time, readable from any thread while it works.

A worker's health answer carries it, and the router turns two answers into the share of the time
between them that the engine worked (its utilization: what the online planner reads to tell a tier
that is idle from one whose work merely came and went between two looks). The work in progress
counts as it runs, so a step of two seconds shows as two seconds spread over the looks that saw it
run, not as nothing and then everything at once.
"""
from __future__ import annotations

import threading
import time


class BusyClock:
    """Wall seconds spent between ``begin()`` and ``end()``, summed; one thread times, any reads.

    The clock is read and the sum updated under one lock: a reader that read the time outside it
    could count a step as still running past the end its thread recorded, and the next reading
    would go back (the router takes differences of readings: it would see a negative utilization).
    Uncontended, the lock costs a step well under a microsecond.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0  # finished work's
        self._started_s: float | None = None  # when the work now running began

    def begin(self) -> None:
        with self._lock:
            self._started_s = time.perf_counter()

    def end(self) -> None:
        with self._lock:
            if self._started_s is not None:
                self._seconds += time.perf_counter() - self._started_s
                self._started_s = None

    @property
    def seconds(self) -> float:
        """Busy seconds of the finished work."""
        return self._seconds

    def now(self) -> float:
        """Busy seconds so far, the work now running included."""
        with self._lock:
            started_s = self._started_s
            return self._seconds if started_s is None else self._seconds + (time.perf_counter() - started_s)
