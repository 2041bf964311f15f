"""Run ``epd serve`` as a user does (a real process tree on loopback) and always stop it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from epd.server.parent import child_environment


class ServeProcess:
    def __init__(self, *args: str, timeout_s: float = 240.0, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "epd", "serve", "--port", "0", "--grpc-port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, start_new_session=True,
                                     # a test process that dies takes its epd serve with it
                                     env={**child_environment(dict(os.environ)), **(env or {})})
        self.lines: list[str] = []
        self.base_url = self.grpc_address = None
        self.worker_metrics_urls: list[str] = []  # each worker's own /metrics, from the banner
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
        if not ready.wait(timeout_s) or self.base_url is None:
            self.stop()
            raise RuntimeError("epd serve did not become ready:\n" + "\n".join(self.lines[-40:]))

    def _drain(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if m := re.search(r"OpenAI API\s+(http://\S+)/v1", line):
                self.base_url = m.group(1)
            if m := re.search(r"gRPC API\s+(\S+)", line):
                self.grpc_address = m.group(1)
            if m := re.search(r"\(pid \d+\) metrics (http://\S+)$", line):
                self.worker_metrics_urls.append(m.group(1))
            if "(Ctrl-C stops everything)" in line:  # the banner's last line: every worker is listed
                ready.set()
        ready.set()

    def stop_and_check_clean(self, model_dir) -> None:
        """Stop; it must exit 0 and leave no process of ours serving ``model_dir``."""
        assert self.stop() == 0, "\n".join(self.lines[-30:])
        left = subprocess.run(["pgrep", "-f", f"epd (router|encoder|prefill|decode) --model {model_dir}"],
                              capture_output=True).stdout
        assert not left, f"epd serve left processes behind: {left!r}"

    def stop(self, timeout_s: float = 40.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def wait_until(predicate, timeout_s: float, period_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return False
