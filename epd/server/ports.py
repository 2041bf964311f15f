"""Ports a launch needs, checked before it starts anything: a taken one is one line naming the port
and the flag that set it (exit 1), not a traceback from a process that started, loaded its model
and then failed to bind while every other tier was already up."""
from __future__ import annotations

import socket


class PortTaken(Exception):
    """A port this launch needs is in use (the message names it and its flag)."""


def check_free(host: str, port: int, flag: str) -> None:
    """``host:port`` can be bound now (0 always can: the OS picks), else ``PortTaken``. Like the
    servers that will bind it, the probe allows reusing a port whose old connections linger
    (TIME_WAIT), not one another process listens on."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise PortTaken(f"{flag} {port}: {host}:{port} is in use ({err.strerror}; another epd serve?); "
                            f"give {flag} another port, or 0 for a free one") from None


def check_router_ports(router) -> None:
    """The router's HTTP, gRPC and admin ports (``RouterConfig``)."""
    if router.http_fd is None:  # an inherited socket is bound already, by the launcher
        check_free(router.host, router.port, "--port")
    if router.public_grpc:
        check_free(router.host, router.grpc_port, "--grpc-port")
    if router.admin_port is not None:
        check_free(router.admin_host, router.admin_port, "--admin-port")


def check_serve_ports(config) -> None:
    """Every fixed port ``epd serve`` (local launcher) binds: the router's, and a decode stream
    port, which several decode workers could not share (the workers' own ports are picked free)."""
    router = config.router
    check_router_ports(router)
    stream_port = config.worker.stream_port
    if stream_port and not router.aggregated:
        if config.decodes > 1:
            raise PortTaken(f"--stream-port {stream_port} with {config.decodes} decode workers: each needs a port of "
                            "its own; use 0 (each gets a free one, announced in its health answer)")
        check_free(config.worker.host, stream_port, "--stream-port")


def exit_if_taken(prog: str, check) -> None:
    """``check()``, or its ``PortTaken`` as one line on stderr and exit code 1."""
    import sys
    try:
        check()
    except PortTaken as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
