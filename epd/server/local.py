"""Start tier processes (and the router) on this machine and stop every one of them again.

Each tier runs as ``epd <tier> --port 0 ...`` (forked from the zygote, ``epd.server.zygote``, or
started cold as ``python -m epd <tier> ...``) and prints ``EPD_READY <tier> <address>`` once
serving; the launcher waits for those lines (bounded) and keeps draining the output so a chatty
worker can never block on a full pipe. Validated configs reach the children as YAML through
a pipe (``--config /dev/fd/N``): nothing on disk, so nothing is left behind however this process
ends, and API keys never touch a file. Every child dies with this process (``epd.server.parent``).
"""
from __future__ import annotations

import fcntl
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import yaml
from pydantic import BaseModel

from epd.engine.threads import EPD_NUM_THREADS, OMP_NUM_THREADS, usable_cores
from epd.server.gpu_sharing import device_args
from epd.server.parent import PARENT_PID_ENV, child_environment
from epd.server.process import READY_PREFIX
from epd.server.zygote_client import ForkedProcess, Zygote, ZygoteGone
from epd.shm_owners import cleanup_stale_segments

log = logging.getLogger("epd.server")

_FIRST_RESTART_DELAY_S = 1.0  # doubles with every restart of the same worker ...
_MAX_RESTART_DELAY_S = 30.0  # ... up to this: a worker that keeps dying does not spin


@dataclass
class TierProcess:
    tier: str
    proc: subprocess.Popen | ForkedProcess
    address: str | None = None  # the first field after the tier name in the ready line
    ready_fields: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0  # how often this worker (this address) was restarted
    restart_at_s: float | None = None  # monotonic time a dead worker is due to restart
    given_up: bool = False  # dead, restarted max_restarts times: left down
    args: tuple[str, ...] = ()  # this worker's own flags (its device), kept across restarts
    echo: Callable[[str], None] | None = None  # each output line as it comes, prefixed with who wrote it
    on_ready: Callable[["TierProcess"], None] | None = None  # told once, when its ready line comes
    started_s: float = field(default_factory=time.monotonic)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(READY_PREFIX) and not self.ready_fields:
                self.ready_fields = line.split()[2:]
                self.address = self.ready_fields[0]
                self._ready.set()
                if self.echo is not None:  # start-up progress, one process at a time as each comes up
                    self._echo(f"({self.tier} pid={self.proc.pid}) ready at {self.address}, "
                               f"{time.monotonic() - self.started_s:.1f} s after its start")
                if self.on_ready is not None:
                    self.on_ready(self)
            elif self.echo is not None and not line.startswith(READY_PREFIX):
                self._echo(f"({self.tier} pid={self.proc.pid}) {line}")
            self.log_lines.append(line)
            del self.log_lines[:-200]  # keep the tail for error messages
        self._ready.set()  # exited: wake the waiter

    def _echo(self, line: str) -> None:
        """Shown as it comes; an echo that fails is dropped, never the drain: a drain that stopped
        would leave the process blocked on a full pipe and its ready line unread."""
        try:
            self.echo(line)
        except Exception:  # noqa: BLE001 - whatever it was, the lines must keep being read
            self.echo = None
            log.exception("%s pid=%d: its output is no longer shown", self.tier, self.proc.pid)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log_lines[-n:])


def _config_pipe(config: BaseModel) -> int:
    """-> the read end of a pipe that holds ``config`` as YAML, for a child to read as
    ``--config /dev/fd/N``. A thread writes it (a config past the pipe's buffer would block here
    otherwise) and ends when the child has read it all or is gone."""
    read_fd, write_fd = os.pipe()
    if read_fd < 3:  # this process runs without some of stdin/out/err: the child's own would take it
        low_fd, read_fd = read_fd, fcntl.fcntl(read_fd, fcntl.F_DUPFD_CLOEXEC, 3)
        os.close(low_fd)
    # what was set, even at a default's value: a worker decides what was left unset itself (on CUDA an
    # unset max_model_len is the checkpoint's, a given 4096 stays 4096)
    data = yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True)).encode()

    def write() -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view):]
        except OSError:  # the child exited without reading: nothing to hand over
            pass
        finally:
            os.close(write_fd)

    threading.Thread(target=write, name="config-pipe", daemon=True).start()
    return read_fd


def tier_threads(num_processes: int, environ: Mapping[str, str] | None = None) -> int | None:
    """Intra-op threads for each of ``num_processes`` compute tiers sharing this host: the cores
    this process may use (``epd.engine.threads.usable_cores``) split between them, at least one each.
    None: each process sizes its own (one process, or the user set EPD_NUM_THREADS / OMP_NUM_THREADS).

    Why: every tier runs barrier-synchronized OpenMP teams. When their threads outnumber the cores,
    a team waits at every barrier for a member the kernel has descheduled, and all tiers crawl. On
    2 cores, 1E1P1D with torch's default (2 threads each) reached 0.11 req/s of goodput at 4 req/s
    (small preset, TTFT <= 500 ms, TPOT <= 60 ms); one thread each reached 2.9-3.3 (sweep_serving.py).
    EPD's premise is one core set per stage; this is that split on one machine.
    """
    environ = os.environ if environ is None else environ
    if num_processes < 2 or EPD_NUM_THREADS in environ or OMP_NUM_THREADS in environ:
        return None
    return max(1, usable_cores() // num_processes)


def port_outside_ephemeral_range(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A free port below the kernel's ephemeral range (0 if none is found: the kernel picks).

    Why: a worker that dies is restarted on its own port, so the router's address for it stays
    valid. A port from the ephemeral range may meanwhile be taken by any outgoing connection on the
    host; one below it is only ever taken by a listener that asked for it.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    first = 20000 if low > 21000 else 1024
    if low - first < 256:
        return 0
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(first, low)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    return 0


class LocalCluster:
    """``with LocalCluster("tiny-qwen2-vl", num_encoders=2) as c: c.encoders, c.prefills, c.decodes``."""

    def __init__(self, model: str, *, num_encoders: int = 1, num_prefills: int = 1, num_decodes: int = 1,
                 transport: str = "", tier_args: dict[str, Sequence[str]] | None = None,
                 env: dict[str, str] | None = None, threads_per_tier: int | None = None,
                 worker_config: BaseModel | None = None,
                 devices: Mapping[str, Sequence[str]] | None = None,
                 echo: Callable[[str], None] | None = None,
                 on_ready: Callable[[TierProcess], None] | None = None,
                 worker_args: Mapping[str, Sequence[Sequence[str]]] | None = None, zygote: bool = True) -> None:
        """``threads_per_tier``: intra-op threads of each tier process, passed as EPD_NUM_THREADS
        (default: ``tier_threads``; a tier's own ``num_threads`` config still wins);
        ``worker_config``: a ``WorkerConfig`` every tier starts from (flags and ``tier_args`` win);
        ``devices``: per tier, the ``--device`` of its workers in turn
        (round robin; a restart keeps its worker's); ``worker_args``: per tier, each worker's own
        extra arguments in turn (e.g. ``--host-id`` to place workers on hosts of their own);
        ``echo``: called with each output line of every process started, prefixed ``(tier pid=N)``
        (default: lines are kept, the last ones shown when a process fails); ``on_ready``: called
        with each process (workers, router, restarts) as it reports ready (``epd serve``'s progress);
        ``zygote``: fork every process from one that imported their code once (``epd.server.zygote``;
        a start or restart then costs the model load, not the imports); False: each starts cold."""
        self.model, self.transport = model, transport
        self.counts = {"encoder": num_encoders, "prefill": num_prefills, "decode": num_decodes}
        self.tier_args = tier_args or {}
        given_env = {**os.environ, **(env or {})}
        threads = threads_per_tier or tier_threads(sum(self.counts.values()), given_env)
        self.threads_per_tier = threads
        self.env = {**given_env, **({EPD_NUM_THREADS: str(threads)} if threads else {}), **(env or {})}
        self.processes: list[TierProcess] = []
        self._worker_config = worker_config
        self.echo = echo  # every process's output lines as they come (epd serve prints them), or kept quiet
        self.on_ready = on_ready
        self.devices = {tier: list(d) for tier, d in (devices or {}).items() if d}
        self.worker_args = {tier: [tuple(a) for a in args] for tier, args in (worker_args or {}).items() if args}
        self.use_zygote = zygote
        self._zygote: Zygote | None = None

    def _shared_gpu_args(self) -> dict[tuple[str, int], tuple[str, ...]]:
        """Engines that share a GPU with other workers split it (``epd.server.gpu_sharing``)."""
        if self._worker_config is None:
            return {}
        from epd.models.locate import resolve_model
        from epd.server.gpu_sharing import shared_gpu_args

        return shared_gpu_args(self.counts, self.devices, self._worker_config, resolve_model(self.model))

    def addresses(self, tier: str) -> list[str]:
        return [p.address for p in self.processes if p.tier == tier]

    @property
    def encoders(self) -> list[str]:
        return self.addresses("encoder")

    @property
    def prefills(self) -> list[str]:
        return self.addresses("prefill")

    @property
    def decodes(self) -> list[str]:
        return self.addresses("decode")

    def start(self, timeout_s: float = 180.0) -> "LocalCluster":
        try:
            sharing = self._shared_gpu_args()
            for tier, count in self.counts.items():
                devices = self.devices.get(tier)
                for i in range(count):
                    args = device_args(devices[i % len(devices)]) if devices else ()
                    if own := self.worker_args.get(tier):
                        args += own[i % len(own)]
                    self.processes.append(self._spawn(tier, (*args, *sharing.get((tier, i), ()))))
            deadline = time.monotonic() + timeout_s
            for p in self.processes:
                p._ready.wait(max(0.0, deadline - time.monotonic()))
                if p.address is None:
                    raise RuntimeError(f"{p.tier} worker did not become ready within {timeout_s:.0f} s "
                                       f"(exit code {p.proc.poll()}); its last output:\n{p.tail()}")
        except BaseException:
            self.stop()
            raise
        return self

    def start_router(self, *, host: str = "127.0.0.1", port: int = 0, grpc_port: int = 0,
                     extra_args: Sequence[str] = (), timeout_s: float = 120.0,
                     config: BaseModel | None = None, http_socket: socket.socket | None = None,
                     env: Mapping[str, str] | None = None) -> TierProcess:
        """Start the router over the running workers; its ready line names the HTTP URL and the
        public gRPC address (``ready_fields``: ``http://h:p``, ``grpc=h:p``). ``config``: a
        ``RouterConfig`` to start from (the worker lists, listeners and ``extra_args`` win);
        ``http_socket``: a listening socket it serves HTTP on (inherited, kept open here for the
        next router); ``env``: its own environment variables (the admin token: no worker gets it)."""
        config_fd = _config_pipe(config) if config is not None else None
        args = ["--config", f"/dev/fd/{config_fd}"] if config_fd is not None else []
        args += ["--host", host, "--port", str(port), "--grpc-port", str(grpc_port),
                 "--encoders", ",".join(self.encoders), "--prefills", ",".join(self.prefills),
                 "--decodes", ",".join(self.decodes), *extra_args]
        if http_socket is not None:  # the router has it under the same number
            args += ["--http-fd", str(http_socket.fileno())]
        if self.transport:
            args += ["--transport", self.transport]
        proc = self._start("router", ["router", "--model", self.model, *args], config_fd=config_fd,
                           keep_fds=(http_socket.fileno(),) if http_socket is not None else (), env=env)
        self.processes.append(proc)
        proc._ready.wait(timeout_s)
        if proc.address is None:
            raise RuntimeError(f"router did not become ready within {timeout_s:.0f} s "
                               f"(exit code {proc.proc.poll()}); its last output:\n{proc.tail()}")
        return proc

    def add_worker(self, tier: str) -> TierProcess:
        """One more worker of ``tier`` (the planner's scale-up), started like the first ones (the next
        of the tier's devices, round robin); ready once its ``_ready`` is set."""
        devices = self.devices.get(tier)
        args = device_args(devices[self.counts[tier] % len(devices)]) if devices else ()
        p = self._spawn(tier, args)
        self.counts[tier] += 1
        self.processes.append(p)
        return p

    def retire(self, p: TierProcess, timeout_s: float = 30.0) -> int | None:
        """Stop a worker for good (the planner's scale-down, once the router drained it): it leaves
        supervision first, then SIGINT (it finishes what it holds), then SIGKILL at ``timeout_s``;
        its shared memory is reclaimed. -> its exit code."""
        p.given_up = True  # not restarted from here on
        if p in self.processes:
            self.processes.remove(p)
            self.counts[p.tier] -= 1
        self._signal_and_wait([p], signal.SIGINT, time.monotonic() + timeout_s)
        cleanup_stale_segments()
        return p.proc.poll()

    def supervise(self, max_restarts: int, now_s: float | None = None) -> list[str]:
        """One round of supervision; call it a few times a second. A worker that exited has its
        shared memory reclaimed at once and is restarted on its own port (so the router's address
        for it stays valid; the router takes it back into rotation when it answers), after a delay
        that doubles with each restart, at most ``max_restarts`` times; then it stays down and the
        router's ``/health`` shows the tier degraded. The router is not restarted here: it holds
        every request's state, so its death ends the service (``epd serve`` stops and says so).
        -> what happened, one line per event."""
        now_s = time.monotonic() if now_s is None else now_s
        events = []
        for index, p in enumerate(self.processes):
            if p.tier == "router" or p.given_up or p.proc.poll() is None:
                continue
            if p.restart_at_s is None:
                events.append(self._on_death(p, max_restarts, now_s))
            elif now_s >= p.restart_at_s:
                self.processes[index] = self._restart(p)
                events.append(f"{p.tier} {p.address} restarted (pid {self.processes[index].proc.pid})")
        return events

    def _on_death(self, p: TierProcess, max_restarts: int, now_s: float) -> str:
        died = f"{p.tier} {p.address} (pid {p.proc.pid}) exited with {p.proc.returncode}"
        reclaimed = len(cleanup_stale_segments())  # the dead producer's segments (its owner lock is free)
        if p.restarts >= max_restarts:
            p.given_up = True
            return f"{died}; reclaimed {reclaimed} shm segment(s); restarted {p.restarts} time(s) already " \
                   f"(max_restarts={max_restarts}): left down. Its last output:\n{p.tail()}"
        delay_s = min(_MAX_RESTART_DELAY_S, _FIRST_RESTART_DELAY_S * 2 ** p.restarts)
        p.restart_at_s = now_s + delay_s
        return f"{died}; reclaimed {reclaimed} shm segment(s); restarting in {delay_s:.0f} s " \
               f"({p.restarts + 1} of {max_restarts})"

    def _restart(self, p: TierProcess) -> TierProcess:
        fresh = self._spawn(p.tier, p.args, port=int(p.address.rsplit(":", 1)[1]))
        fresh.address, fresh.restarts, fresh.args = p.address, p.restarts + 1, p.args
        return fresh

    def _spawn(self, tier: str, args: Sequence[str] = (), port: int = 0) -> TierProcess:
        port = port or port_outside_ephemeral_range()
        config_fd = _config_pipe(self._worker_config) if self._worker_config is not None else None
        p = self._start(tier, self._worker_argv(tier, args, port, config_fd), config_fd=config_fd)
        p.args = tuple(args)
        return p

    def _worker_argv(self, tier: str, args: Sequence[str] = (), port: int = 0,
                     config_fd: int | None = None) -> list[str]:
        """``epd <tier> ...``'s arguments, the tier first; ``config_fd``: where it reads the worker config."""
        cmd = [tier]
        if config_fd is not None:
            cmd += ["--config", f"/dev/fd/{config_fd}"]
        # each worker's own listeners: never two on one port
        cmd += ["--model", self.model, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                *self.tier_args.get(tier, ())]
        if self.transport:
            cmd += ["--transport", self.transport]
        return cmd + list(args)

    def _start(self, tier: str, argv: list[str], config_fd: int | None = None, keep_fds: Sequence[int] = (),
               env: Mapping[str, str] | None = None) -> TierProcess:
        """``epd <argv>``: forked from the zygote (started with the first), or cold when there is
        none (or it is gone: said once, and every later start is cold). As ``_popen`` for the rest."""
        if self.use_zygote:
            try:
                return self._fork(tier, argv, config_fd, keep_fds, env)
            except ZygoteGone as gone:
                self.use_zygote = False
                message = f"(zygote) {gone}; starting processes cold from now on"
                self.echo(message) if self.echo is not None else print(message, file=sys.stderr, flush=True)
        return self._popen(tier, [sys.executable, "-m", "epd", *argv], config_fd=config_fd, keep_fds=keep_fds,
                           env=env)

    def _fork(self, tier: str, argv: list[str], config_fd: int | None, keep_fds: Sequence[int],
              env: Mapping[str, str] | None) -> TierProcess:
        if self._zygote is None:
            tiers = [tier for tier, count in self.counts.items() if count]
            self._zygote = Zygote(child_environment(self.env), tiers=tiers, model=self.model, router=True)
        child_env = {**child_environment({**self.env, **(env or {})}), PARENT_PID_ENV: str(self._zygote.proc.pid)}
        read_fd, write_fd = os.pipe()
        stdin_fd = os.open(os.devnull, os.O_RDONLY)
        fds = [(write_fd, 1), (stdin_fd, 0), *(((config_fd, config_fd),) if config_fd is not None else ()),
               *((fd, fd) for fd in keep_fds)]
        try:
            proc = self._zygote.spawn(argv, child_env, fds)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
            os.close(stdin_fd)
        if config_fd is not None:
            os.close(config_fd)
        proc.stdout = os.fdopen(read_fd, "r")
        tp = TierProcess(tier, proc, echo=self.echo, on_ready=self.on_ready)
        threading.Thread(target=tp._drain, name=f"drain-{tier}", daemon=True).start()
        return tp

    def _popen(self, tier: str, cmd: list[str], config_fd: int | None = None,
               keep_fds: Sequence[int] = (), env: Mapping[str, str] | None = None) -> TierProcess:
        """Start ``cmd``; it dies with this process (``epd.server.parent``); ``config_fd``: a pipe's
        read end it inherits (closed here once it has it); ``keep_fds``: others it inherits (kept)."""
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    env=child_environment({**self.env, **(env or {})}), start_new_session=True,
                                    pass_fds=(*((config_fd,) if config_fd is not None else ()), *keep_fds))
        finally:
            if config_fd is not None:
                os.close(config_fd)
        tp = TierProcess(tier, proc, echo=self.echo, on_ready=self.on_ready)
        threading.Thread(target=tp._drain, name=f"drain-{tier}", daemon=True).start()
        return tp

    def stop(self, timeout_s: float = 30.0) -> None:
        """The router first (SIGTERM: it lets its streams finish), then the workers with SIGINT:
        each drains what it still holds (its calls from the router are cancelled by now, so that
        is short) but skips the DRAINING notice that SIGTERM gives routers, as none is left to see
        it. Whatever is still running at ``timeout_s`` is killed."""
        routers = [p for p in self.processes if p.tier == "router"]
        workers = [p for p in self.processes if p.tier != "router"]
        # each its own ``timeout_s``: a router that used all of its grace must not cost the workers
        # theirs (killed, they would leave their shared memory for the next start to reclaim)
        self._signal_and_wait(routers, signal.SIGTERM, time.monotonic() + timeout_s)
        self._signal_and_wait(workers, signal.SIGINT, time.monotonic() + timeout_s)
        self.processes.clear()
        if self._zygote is not None:  # its children are stopped: it goes too
            self._zygote.close()
            self._zygote = None

    @staticmethod
    def _signal_and_wait(processes: list[TierProcess], sig: signal.Signals, deadline: float) -> None:
        """``sig`` to ``processes``, then wait for all of them until ``deadline``; a process still
        running then is killed."""
        for p in processes:
            if p.proc.poll() is None:
                p.proc.send_signal(sig)
        for p in processes:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # not a group leader (a process started without its own session)
                    p.proc.kill()
                p.proc.wait(5)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
