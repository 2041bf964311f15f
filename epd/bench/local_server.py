"""A serving process on loopback for a measurement (``epd profile --pipeline``, the benchmark
scripts): started in a session of its own, its output kept, ready once a line names its URL, always
stopped (SIGTERM, then the whole group killed). Bounded waits throughout."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass

from epd.server.parent import child_environment

SERVE_URL = re.compile(r"OpenAI API\s+(http://\S+)/v1|EPD_READY router (http://\S+)")
# a process in ``epd serve``'s ready banner: "  decode      127.0.0.1:5 (pid 7) metrics http://..."
_BANNER_PROCESS = re.compile(r"^\s+(router|encoder|prefill|decode)\s+(\S+) \(pid (\d+)\)(?: metrics (\S+))?$")


@dataclass(frozen=True)
class BannerProcess:
    tier: str  # router, encoder, prefill or decode
    address: str  # a worker's host:port; a router's URL
    pid: int
    metrics_url: str | None  # a worker's own /metrics (routers serve theirs at their URL)


def banner_processes(lines: list[str]) -> list[BannerProcess]:
    """The processes ``epd serve``'s ready banner names, in its order (the routers, then the workers)."""
    return [BannerProcess(m.group(1), m.group(2), int(m.group(3)), m.group(4))
            for line in lines if (m := _BANNER_PROCESS.match(line.rstrip("\n")))]


class LocalServer:
    """``with LocalServer([...command...]) as s: s.url``; ``s.lines``: its output so far."""

    def __init__(self, command: list[str], *, name: str = "server", timeout_s: float = 300.0,
                 url_line: re.Pattern = SERVE_URL) -> None:
        self.command, self.name, self.timeout_s, self.url_line = command, name, timeout_s, url_line
        self.url: str | None = None
        self.lines: list[str] = []

    def __enter__(self) -> LocalServer:
        # its session is its own (a terminal's Ctrl-C reaches us, and we stop it), but not its life:
        # with our pid in its environment it stops when we are gone, however we went
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                     env=child_environment(dict(os.environ)))
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(self.timeout_s) or self.url is None:
            self.__exit__()
            raise RuntimeError(f"{self.name} did not start:\n" + "\n".join(self.lines[-30:]))
        return self

    def _drain(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if self.url is None and (m := self.url_line.search(line)):
                self.url = next(g for g in m.groups() if g)
                ready.set()
        ready.set()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
