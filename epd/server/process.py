"""What every EPD process does the same way: log format, the ready line launchers wait for, and a
clean stop on SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal
import sys
import threading

READY_PREFIX = "EPD_READY"  # "EPD_READY <tier> <address> [more fields]": the launcher's signal


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def announce_ready(tier: str, *fields: str) -> None:
    print(" ".join((READY_PREFIX, tier, *fields)), flush=True)


def wait_for_stop_signal() -> None:
    """Block until SIGTERM or SIGINT (main thread only)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
