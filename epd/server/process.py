"""What every EPD process does the same way: log format, open-file limit, the ready line launchers
wait for, a clean stop on SIGTERM/SIGINT or when its launcher dies, and a cheap exit."""
from __future__ import annotations

import enum
import logging
import os
import resource
import signal
import sys
import threading

from epd import heap
from epd.server.parent import watch_parent

READY_PREFIX = "EPD_READY"  # "EPD_READY <tier> <address> [more fields]": the launcher's signal
def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """stderr, at ``level``; ``fmt`` text lines or JSON objects (one a line: time, level, logger,
    message, and the exception's text when there is one). Again with other settings: replaced."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit; -> the soft limit now.

    Every connection is a file, and so is every shared-memory mapping (Python's mmap keeps a
    descriptor per mapping): a router with a thousand streaming clients, or a prefill worker with
    a thousand KV segments pooled for decode, passes the common default of 1024 and would fail
    calls with "too many open files" under exactly the load it is sized for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as err:  # a container may forbid it: run with what we have
            logging.getLogger("epd.server").warning("open-files limit stays %d (could not raise it to %s: %s)",
                                                    soft, hard, err)
            return soft
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def announce_ready(tier: str, *fields: str) -> None:
    """The launcher's signal that the process serves (its collector set for serving first)."""
    heap.settle_for_serving()
    print(" ".join((READY_PREFIX, tier, *fields)), flush=True)


class Stop(enum.Enum):
    """Why a process stops: how much of a graceful stop it owes."""

    TERM = "SIGTERM"  # a supervisor's (Kubernetes, Ray, epd serve to the router): drain, routers told
    INT = "SIGINT"  # Ctrl-C, or a launcher that stopped the router first: drain, nobody left to tell
    PARENT_GONE = "launcher gone"  # its launcher died: no one to drain for, stop at once
    ENGINE_LOST = "engine lost"  # its engine can never step again (a tensor-parallel rank died): stop at once


def stop_engine_lost(reason: str) -> None:
    """From any thread: this process's engine can never step again; ``wait_for_stop`` returns
    ``Stop.ENGINE_LOST`` (a signal to itself: the main thread may be blocked in the wait)."""
    logging.getLogger("epd.server").error("the engine is lost (%s): stopping at once, its requests move to other "
                                          "workers", reason)
    os.kill(os.getpid(), signal.SIGUSR1)


def wait_for_stop() -> Stop:
    """Block until SIGTERM, SIGINT, the death of the launcher that started this process
    (``epd.server.parent``) or ``stop_engine_lost``; main thread only. -> which came first."""
    stop = threading.Event()
    received: list[Stop] = []

    def on(reason: Stop) -> None:
        received.append(reason)
        stop.set()

    signal.signal(signal.SIGTERM, lambda *_: on(Stop.TERM))
    signal.signal(signal.SIGINT, lambda *_: on(Stop.INT))
    signal.signal(signal.SIGUSR1, lambda *_: on(Stop.ENGINE_LOST))
    watch_parent(lambda: on(Stop.PARENT_GONE))
    stop.wait()
    return received[0]
