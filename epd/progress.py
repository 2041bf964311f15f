"""Progress while a cluster starts and while weights load: a bar in a line of text.

A large model takes minutes to load and a cluster starts many processes; a user should see how
far along each is, in a terminal and in a log file alike. A line per step (not a redrawn line)
reads the same in both, and survives the prefixing that ``epd serve`` gives its workers' lines.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

BAR_WIDTH = 20


def bar(done: float, total: float, width: int = BAR_WIDTH) -> str:
    """``[#########-----------]``: ``done`` of ``total`` (clamped; an empty total is complete)."""
    fraction = 1.0 if total <= 0 else min(1.0, max(0.0, done / total))
    filled = round(fraction * width)
    return f"[{'#' * filled}{'-' * (width - filled)}]"


class StartProgress:
    """How many of a launch's processes are ready: one line as each reports ready, with a bar, the
    count and the time since the launch began. After ``finish`` (the service is up), processes that
    come back after a restart say so in their own lines; no bar is drawn for them."""

    def __init__(self, total: int, print_line: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.total, self.ready = total, 0
        self._print, self._clock = print_line, clock
        self._started_s = clock()
        self._lock = threading.Lock()  # one drain thread per process reports
        self._finished = False

    def process_ready(self, process) -> None:
        with self._lock:
            if self._finished:
                return
            self.ready += 1
            line = (f"epd serve: {bar(self.ready, self.total)} {self.ready} of {self.total} processes ready "
                    f"({process.tier} at {process.address}), {self._clock() - self._started_s:.1f} s")
        self._print(line)

    def finish(self) -> None:
        with self._lock:
            self._finished = True
