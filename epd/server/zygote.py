"""The zygote: one process that imports what EPD's processes run once, then forks each worker and
router the launcher asks for (``python -m epd.server.zygote --fd N [--tiers T,...] [--router MODEL]``).

Why: a cold start is mostly imports. torch alone is ~1.5 s of CPU, transformers' vision towers
~2 s more for an encoder, the router's code and tokenizer ~3 s; every worker paid them again, at
start and at each restart, and on a small host they compete with the workers already serving. A
child forked from a process that holds them all costs only what is its own: the model load and
its listeners. Its pages stay shared with the zygote until written (the imported code is never
written), so N workers hold torch's code once. The preloaded objects are frozen out of the
garbage collector's reach first (``gc.freeze``): the children neither scan nor copy them.

The launcher (``epd.server.zygote_client.Zygote``) speaks to it over a Unix socket of packets: a
start is one packet of JSON (``id``, ``argv`` of ``epd``, ``env``, and ``fds``: the number each passed file
descriptor gets in the child, stdout first) with the descriptors themselves attached; the zygote
answers ``{"id", "pid"}``, and ``{"exited": pid, "code"}`` when a child it forked ends (the exit
code as ``subprocess`` gives it: minus the signal's number for a killed one). The zygote forks
only from its single thread, before any torch work: no lock or thread pool of another thread is
copied half-held. When the launcher is gone (the socket's other end closes), the zygote exits;
its children then see their parent go and stop (``epd.server.parent``).
"""
from __future__ import annotations

import argparse
import atexit
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable

from epd import heap

ZYGOTE_READY = "EPD_ZYGOTE ready"
MAX_PACKET_BYTES = 1 << 20
_MAX_FDS = 16
_TIER_PRELOAD = ("torch", "numpy", "epd.server.tier", "epd.models.registry", "epd.models.presets")
_ROUTER_PRELOAD = ("epd.server.router", "epd.router.openai.app", "epd.router.grpc_api",
                   "epd.router.backends.disaggregated", "epd.router.backends.in_process")
_PR_SET_NAME = 15


def preload_steps(tiers: list[str], model: str | None, router: bool) -> list[Callable[[], None]]:
    """What to import for ``tiers`` (and a router) serving ``model``, in the order it is needed:
    the workers' code first (they are forked as soon as it is in), the router's last (it starts
    once the workers listen). A module this build lacks, or a model not found here, is left to
    the child to meet and report."""
    model_dir = _model_dir(model)
    steps = [lambda: _import(*_TIER_PRELOAD, *(f"epd.{tier}.servicer" for tier in tiers))]
    if "encoder" in tiers and model_dir is not None:
        steps.append(lambda: _preload_vision(model_dir))
    if router:
        steps.append(_ROUTER_STEP)
        if model_dir is not None:
            steps.append(lambda: _preload_tokenizer(model_dir))
    return steps


def _import_router() -> None:
    _import(*_ROUTER_PRELOAD)


_ROUTER_STEP = _import_router


def _import(*names: str) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _preload_tokenizer(model_dir) -> None:
    """The router reads the process's tokenizer cache (``epd.models.tokenizer_loading``): loaded
    here, it is loaded once for every router forked."""
    from epd.models.tokenizer_loading import load_tokenizer
    try:
        load_tokenizer(model_dir)
    except Exception:  # noqa: BLE001 - the router meets the same problem and says it properly
        pass


def _model_dir(model: str | None):
    if model is None:
        return None
    try:
        from epd.models.locate import resolve_model
        return resolve_model(model)
    except Exception:  # noqa: BLE001 - not here yet (a hub id to download): the child resolves it
        return None


def _preload_vision(model_dir) -> None:
    """The encoder's vision tower code (transformers', ~2 s of CPU to import)."""
    try:
        from epd.models.checkpoint import read_config
        from epd.models.qwen2_vl.vision import tower_class
        tower_class(read_config(model_dir).get("model_type", ""))
    except Exception:  # noqa: BLE001 - the encoder imports it itself and reports a failure
        pass


def serve(sock: socket.socket, steps: list[Callable[[], None]]) -> dict | None:
    """Fork a child per request until the launcher lets go; ``steps`` (more preloading) run one at
    a time whenever no request waits, so a child has what ran before its fork (a router forked
    before the router's step imports its code itself). -> in a forked child, its request (``fds``
    already in place); None in the zygote once it is done."""
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [], 0 if steps else None)
            if not readable and steps:
                steps.pop(0)()
                _refuse_after_cuda()
                if not steps:
                    heap.freeze_loaded()  # what every child shares
                continue
            if wake_r in readable:
                _drain(wake_r)
            if not _reap(sock):
                return None
            if sock not in readable:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_PACKET_BYTES, _MAX_FDS)
            except OSError:
                return None
            if not data:  # the launcher closed its end (stopped, or died)
                return None
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                sock.close()
                _place_fds(fds, request["fds"])
                return request
            for fd in fds:
                os.close(fd)
            if not _send(sock, {"id": request["id"], "pid": pid}):
                return None
    finally:
        if signal.getsignal(signal.SIGCHLD) is not signal.SIG_DFL:  # the zygote's own way out
            signal.set_wakeup_fd(-1)


def _refuse_after_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print("epd zygote: CUDA was initialized while importing; a forked child could not use it: exiting",
              flush=True)
        os._exit(3)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _reap(sock: socket.socket) -> bool:
    """Tell the launcher of each child that ended; -> False once it cannot be told."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if not _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)}):
            return False


def _send(sock: socket.socket, message: dict) -> bool:
    try:
        sock.send(json.dumps(message).encode())
        return True
    except OSError:
        return False


def _place_fds(fds: list[int], targets: list[int]) -> None:
    """Give each received descriptor the number the child expects (stdout also as stderr). Moved
    above every target first, so placing one never closes another not yet placed."""
    lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64 + max(targets, default=0)) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(lifted, targets):
        os.dup2(fd, target)  # inheritable: as a process started with these descriptors has them
    if targets and targets[0] == 1:
        os.dup2(1, 2)
    for fd in lifted:
        os.close(fd)


def become(request: dict) -> int:
    """In a forked child: the process ``epd <argv>`` would have been."""
    os.setsid()  # its own session and process group, as the launcher's cold starts have
    argv = request["argv"]
    _name_process(argv)  # first: setproctitle finds the command line's memory through the environment
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["epd", *argv]
    _reseed()
    heap.own()  # a forked child is the program, as a cold start is
    from epd.cli import main
    return main(argv)


def _reseed() -> None:
    """Each child its own random state (``random`` reseeds itself after a fork; numpy's and torch's
    global generators would otherwise repeat the zygote's in every child)."""
    seed = int.from_bytes(os.urandom(8), "little")
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def _name_process(argv: list[str]) -> None:
    """What ``ps``, ``pgrep -f`` and /proc/PID/cmdline show: ``epd <argv>``, as for a cold start
    (``python -m epd <argv>``), not the zygote's command line; and ``epd-<tier>`` as its short
    name (``ps -o comm``, ``top``)."""
    try:
        from setproctitle import setproctitle
        setproctitle(" ".join(["epd", *argv]))
    except ImportError:  # an install without it: the zygote's command line stays
        pass
    try:
        import ctypes
        ctypes.CDLL(None).prctl(_PR_SET_NAME, f"epd-{argv[0] if argv else ''}".encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd.server.zygote")
    parser.add_argument("--fd", type=int, required=True, help="the launcher's socket (SOCK_SEQPACKET)")
    parser.add_argument("--tiers", default="", help="tiers whose code to import, comma-separated")
    parser.add_argument("--model", help="the model the children serve (its vision code and tokenizer are loaded)")
    parser.add_argument("--router", action="store_true", help="import the router's code and the model's tokenizer")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sock = socket.socket(fileno=args.fd)
    # CUDA does not survive a fork once its driver is initialized: a check for a GPU made while
    # importing asks NVML instead (no driver init), and a zygote that initialized CUDA anyway
    # refuses to fork (the launcher then starts processes cold)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    steps = preload_steps([t for t in args.tiers.split(",") if t], args.model, args.router)
    while steps and steps[0] is not _ROUTER_STEP:  # the workers' code: before their start
        steps.pop(0)()
    _refuse_after_cuda()
    heap.freeze_loaded()  # what every child shares
    print(ZYGOTE_READY, flush=True)
    request = serve(sock, steps)
    if request is None:  # nothing of its own to tidy: skip the interpreter's teardown of what it imported
        sys.stdout.flush()
        os._exit(0)
    _exit_as_a_child(_run_child(request))


def _run_child(request: dict) -> int:
    try:
        return become(request)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the child's own failure, in its own output
        traceback.print_exc()
        return 1


def _exit_as_a_child(code: int) -> None:
    """Exit as the interpreter would (its threads joined, its atexit handlers run, stdio flushed)
    but without tearing down the modules: each object freed there would first be copied out of the
    pages shared with the zygote (0.3 s of CPU per exit here, three times a cold process's)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # what the interpreter does first at its exit: waits for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
