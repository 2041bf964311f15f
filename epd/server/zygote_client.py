"""The launcher's side of the zygote (``epd.server.zygote``): ``Zygote`` starts it and asks it for
children; ``ForkedProcess`` is such a child as the launcher holds it (what ``LocalCluster`` uses of
``subprocess.Popen``: pid, poll, wait, signals, its stdout)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from epd.server.zygote import MAX_PACKET_BYTES


class ForkedProcess:
    """A child of the zygote as the launcher holds it: what it uses of ``subprocess.Popen`` (its
    exit code comes from the zygote, which reaps it)."""

    def __init__(self, pid: int, stdout, stdin=None) -> None:
        self.pid, self.stdout, self.stdin = pid, stdout, stdin
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteGone(RuntimeError):
    """The zygote exited (or never came up): the launcher starts processes cold instead."""


class Zygote:
    """The launcher's side: ``Zygote(env, tiers=..., model=..., router=True)`` starts the zygote;
    ``spawn(argv, env, fds)`` forks ``epd <argv>`` from it (``ZygoteGone`` if it cannot);
    ``close()`` lets it go (it exits; call once its children are stopped)."""

    def __init__(self, env: Mapping[str, str], *, tiers: Sequence[str], model: str | None, router: bool,
                 start_timeout_s: float = 180.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "epd.server.zygote", "--fd", str(theirs.fileno()), "--tiers", ",".join(tiers)]
        argv += (["--model", model] if model else []) + (["--router"] if router else [])
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env=dict(env),
                                         start_new_session=True, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._sock, self._start_timeout_s = ours, start_timeout_s
        self._lock = threading.Lock()  # one start at a time: its answer is the next pid message
        self._answers: dict[int, ForkedProcess | None] = {}
        self._answered = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._next_id = 0
        self.output: list[str] = []  # the zygote's own lines (a failed import says why here)
        self.gone = False
        threading.Thread(target=self._read_output, name="zygote-output", daemon=True).start()
        threading.Thread(target=self._read, name="zygote", daemon=True).start()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], fds: Sequence[tuple[int, int]]) -> ForkedProcess:
        """``epd <argv>`` in a forked child with ``env`` and ``fds`` (our descriptor, its number in
        the child; the first is its stdout and stderr); ours stay open (the caller closes them)."""
        with self._lock:
            if self.gone:
                raise ZygoteGone(self._why())
            self._next_id += 1
            request = {"id": self._next_id, "argv": list(argv), "env": dict(env), "fds": [t for _, t in fds]}
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [f for f, _ in fds])
            except OSError as err:
                raise ZygoteGone(f"the zygote's socket: {err}") from None
            deadline = time.monotonic() + self._start_timeout_s
            with self._answered:
                while request["id"] not in self._answers and not self.gone and time.monotonic() < deadline:
                    self._answered.wait(max(0.01, deadline - time.monotonic()))
                child = self._answers.pop(request["id"], None)
            if child is None:
                self.gone = True
                raise ZygoteGone(self._why())
            return child

    def _read(self) -> None:
        """The zygote's answers (pids) and its children's exits; on its end, every child still
        running is waited for by its pid (they stop once they see their parent gone)."""
        while True:
            try:
                data = self._sock.recv(MAX_PACKET_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "exited" in message:
                child = self._children.pop(message["exited"], None)
                if child is not None:
                    child._ended(message["code"])
                continue
            child = self._children[message["pid"]] = ForkedProcess(message["pid"], None)
            with self._answered:
                self._answers[message["id"]] = child
                self._answered.notify_all()
        with self._answered:
            self.gone = True
            self._answered.notify_all()
        for child in list(self._children.values()):
            threading.Thread(target=_await_orphan, args=(child,), daemon=True).start()

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))
            del self.output[:-50]

    def _why(self) -> str:
        code = self.proc.poll()
        return f"the zygote (pid {self.proc.pid}) is gone (exit code {code}); its last output:\n" + \
            "\n".join(self.output[-20:])

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the zygote go: it exits (killed at ``timeout_s``)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _await_orphan(child: ForkedProcess, period_s: float = 0.05) -> None:
    """A child whose zygote is gone: ended once its pid is (its code is no longer known: -9)."""
    while child.returncode is None:
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            child._ended(-signal.SIGKILL)
            return
        time.sleep(period_s)
