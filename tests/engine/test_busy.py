"""``BusyClock``: an engine's busy time, read from another thread while the engine works (what its
health answers carry). The work in progress counts as it runs, and readings never go back: the
router takes differences of them, and a reading that went back would be a negative utilization."""
from __future__ import annotations

import sys
import threading
import time

from epd.engine.busy import BusyClock


def test_work_in_progress_counts_while_it_runs_and_idle_time_does_not():
    clock = BusyClock()
    clock.begin()
    time.sleep(0.05)
    during = clock.now()
    assert 0.04 < during < 1.0  # 50 ms of a step still running
    clock.end()
    finished = clock.seconds
    assert finished >= during
    time.sleep(0.05)  # idle: nothing added
    assert clock.now() == finished
    clock.end()  # an end without a begin adds nothing
    assert clock.seconds == finished


def test_readings_from_another_thread_never_go_back():
    """20,000 short steps timed on one thread while another reads as fast as it can, the interpreter
    switching threads every 10 µs: every reading at least the one before it, and the last one the
    sum of the steps (a reader that reads the time and the sum apart, the clock first or last, fails this
    in every run)."""
    clock, stop, went_back, readings = BusyClock(), threading.Event(), [], [0]

    def read() -> None:
        last = 0.0
        while not stop.is_set():
            now = clock.now()
            if now < last:
                went_back.append((last, now))
            last = now
            readings[0] += 1

    interval_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for _ in range(20_000):
            clock.begin()
            clock.end()
    finally:
        stop.set()
        reader.join(10)
        sys.setswitchinterval(interval_s)
    assert readings[0] > 100  # the reader really ran beside the steps
    assert not went_back, went_back[:3]
    assert clock.now() == clock.seconds > 0
