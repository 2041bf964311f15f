"""What every EPD process does the same way: log format, open-file limit, the ready line launchers
wait for, a clean stop on SIGTERM/SIGINT or when its launcher dies, and a cheap exit."""
from __future__ import annotations

import enum
import gc
import logging
import os
import resource
import signal
import sys
import threading

from epd.server.parent import watch_parent

READY_PREFIX = "EPD_READY"  # "EPD_READY <tier> <address> [more fields]": the launcher's signal
_heap_is_ours = False  # the process is an EPD program (not a caller that imported us and goes on)


def own_the_heap() -> None:
    """This process is an EPD program (``epd ...`` run, or forked as one): what it holds once it
    has started may be frozen (``settle_heap_for_serving``) and left at its exit (``freeze_for_exit``)."""
    global _heap_is_ours
    _heap_is_ours = True


YOUNG_COLLECTION_OBJECTS = 10_000  # the youngest generation's threshold while serving (Python's: 700)


def settle_heap_for_serving() -> None:
    """Started: the garbage collector set for serving, in a program only (a caller that goes on,
    a test, keeps its collector as it was).

    What the process loaded (torch's and transformers' objects, the model, the tokenizer, the app)
    is collected once and frozen out of the collector's reach (``gc.freeze``): every full
    collection while serving walked all of it again, ~100-250 ms of CPU each here, several a
    minute under load. Frozen objects are still freed by reference count; only a reference cycle
    among them would stay.

    And the youngest generation is collected every 10,000 net new objects instead of 700: a
    router streaming 256 requests collected it ~90 times a second (a step's or a token's short-
    lived objects are most of what it allocates and frees), and every collection walked the
    requests' live objects again. Together they cut a router's collector CPU under load ~3.5x
    and a decode worker's ~2x (docs/benchmarks.md)."""
    if _heap_is_ours:
        gc.collect()
        gc.freeze()
        gc.set_threshold(YOUNG_COLLECTION_OBJECTS, *gc.get_threshold()[1:])


def freeze_for_exit() -> None:
    """The process's work is done and it is about to exit: what it allocated is moved out of the
    garbage collector's reach (``gc.freeze``), so the interpreter's teardown does not walk it. With
    torch and transformers loaded those final collections cost 0.6-1.3 s of CPU here, at every
    worker's, router's and command's exit (a supervisor restarting workers, a test suite starting
    hundreds). Everything else of the exit stays: atexit handlers, objects freed by reference
    count, stdio flushed."""
    gc.freeze()


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
    settle_heap_for_serving()
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
