"""A child of a launcher dies with it, however the launcher dies.

``epd serve`` (or a test, or a benchmark) starts its workers and router through
``epd.server.local.LocalCluster``, which sets ``EPD_PARENT_PID`` in each child's environment. A
child that has it calls ``watch_parent`` once it can stop cleanly: when the launcher is gone (a
SIGKILL, an OOM kill, a crashed terminal: no chance to stop anyone) the child stops at once, drains
nothing (no router is left to take its answers) and releases its shared memory on the way out. A
worker left running without its launcher would hold its ports, memory and /dev/shm segments until
someone found it by hand.

Two ways to notice, either enough: the kernel's parent-death signal (Linux ``prctl``: immediate),
and a thread that compares ``os.getppid()`` with the launcher's pid twice a second (every
platform). The signal is only a wake-up: it comes when the *thread* that started the child exits,
which need not be the launcher's end, so ``getppid`` decides in both cases.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable

PARENT_PID_ENV = "EPD_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_WAKE_SIGNAL = signal.SIGUSR2
_POLL_S = 0.5
_REAPERS: list = []  # reapers started here (their stdin must stay open while this process runs)

log = logging.getLogger("epd.server")


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` for a child that must die with this process."""
    return {**environ, PARENT_PID_ENV: str(os.getpid())}


def watch_parent(on_gone: Callable[[], None]) -> bool:
    """Call ``on_gone`` once (from a signal handler or a thread) when the launcher named in
    ``EPD_PARENT_PID`` is no longer this process's parent. Call from the main thread (it installs a
    signal handler). -> whether there is a launcher to watch."""
    expected = os.environ.get(PARENT_PID_ENV, "")
    if not expected.isdigit():
        return False
    launcher = int(expected)
    fired = threading.Event()
    once = threading.RLock()  # the signal handler and the polling thread may both see it

    def check() -> None:
        if os.getppid() == launcher or fired.is_set():
            return
        with once:
            if fired.is_set():
                return
            fired.set()
        log.warning("the launcher (pid %d) is gone: stopping now", launcher)
        on_gone()

    if threading.current_thread() is threading.main_thread():
        signal.signal(_WAKE_SIGNAL, lambda *_: check())
        _ask_kernel_for(_WAKE_SIGNAL)

    def poll() -> None:
        while not fired.wait(_POLL_S):
            check()

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()
    check()  # it may have died before the kernel was asked
    return True


def _ask_kernel_for(sig: signal.Signals) -> None:
    """Linux: ``sig`` when the parent goes. Elsewhere (no prctl) the polling thread serves alone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, however deep (children may start sessions of their own;
    the parent link stays)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cpu_seconds(pids) -> float:
    """User and system CPU seconds that the live processes among ``pids`` have spent so far (one that
    is gone by now counts nothing)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None when it is gone: with the pid, the
    identity of a process (a pid alone may be reused by another)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def reap_with_me(pids: list[int]) -> "Reaper":
    """Start a small process that, once this one is gone however it went, ends ``pids`` (each only
    if it is still the process it was now) and then reclaims the shared memory of whatever died:
    for processes started on this process's behalf that do not watch it themselves (the one-node
    Ray ``epd serve --launcher ray`` starts, whose agents and actors outlive a killed driver)."""
    return Reaper(pids)


class Reaper:
    """The process ``reap_with_me`` starts; ``add`` tells it of more processes to end."""

    def __init__(self, pids: list[int]) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen([sys.executable, "-m", "epd.server.parent"], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, env=child_environment(dict(os.environ)),
                                      start_new_session=True, text=True)
        _REAPERS.append(self._proc)  # its stdin stays open while this process lives: EOF means gone
        self.add(pids)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def add(self, pids: list[int]) -> None:
        import json

        known = [(pid, started) for pid in pids if (started := start_time(pid)) is not None]
        self._proc.stdin.write(json.dumps(known) + "\n")
        self._proc.stdin.flush()


def _reap(known: list[tuple[int, int]]) -> None:
    """End ``known`` (pid, start time) processes that are still those processes: SIGTERM, then
    SIGKILL for what is left a few seconds later."""
    import time

    for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)):
        alive = [pid for pid, started in known if start_time(pid) == started]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if start_time(pid) is not None]


def main() -> int:
    """``python -m epd.server.parent``: the reaper ``reap_with_me`` starts (its pids on stdin)."""
    import json
    import sys

    known: list[tuple[int, int]] = []
    gone = threading.Event()
    if not watch_parent(gone.set):
        return 2

    def listen() -> None:  # a line of (pid, start time) pairs per reap_with_me / add; EOF: gone too
        for line in sys.stdin:
            known.extend(tuple(entry) for entry in json.loads(line))
        gone.set()

    threading.Thread(target=listen, daemon=True).start()
    gone.wait()
    _reap(list(known))
    _reclaim_shared_memory()
    return 0


def _reclaim_shared_memory() -> None:
    """Unlink the segments of the producers that ended with the launcher: a Ray actor ended because
    its driver went has no supervisor left to do it, and its next start (which would) never comes.
    Only dead producers' files of this user are touched (``cleanup_stale_segments``)."""
    from epd.shm_owners import cleanup_stale_segments

    cleanup_stale_segments()


if __name__ == "__main__":
    raise SystemExit(main())
