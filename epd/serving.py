"""What every tier process shares: a gRPC server on a host:port, a ready line on stdout that
launchers wait for, and a clean stop on SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from epd.config import WorkerConfig
from epd.errors import EPDError

READY_PREFIX = "EPD_READY"
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024)]


def bind_server(config: WorkerConfig) -> tuple[grpc.Server, str]:
    """Bind (not started: register servicers, which may need the final address, then start)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=config.max_workers), options=GRPC_OPTIONS)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {config.host}:{config.port}")
    return server, f"{config.host}:{port}"


@dataclass
class RunningTier:
    """A started tier in this process: its gRPC server, address and metrics endpoint."""

    tier: str
    server: grpc.Server
    address: str
    on_stop: Callable[[], None]
    metrics_url: str = ""

    def stop(self) -> None:
        logging.getLogger(self.tier).info("stopping %s at %s", self.tier, self.address)
        self.server.stop(grace=2).wait(5)
        self.on_stop()


def start_tier(tier: str, config: WorkerConfig, server: grpc.Server, address: str, on_stop: Callable[[], None],
               metrics=None) -> RunningTier:
    """Start the (bound, servicers added) server and the metrics endpoint."""
    server.start()
    url = ""
    if metrics is not None:
        url = f"http://{config.host}:{metrics.serve(config.host, config.metrics_port)}/metrics"
    return RunningTier(tier, server, address, on_stop, url)


def run_until_signalled(running: RunningTier) -> None:
    """Print the ready line, block until SIGTERM/SIGINT, then stop the tier."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    extra = f" metrics={running.metrics_url}" if running.metrics_url else ""
    print(f"{READY_PREFIX} {running.tier} {running.address}{extra}", flush=True)
    stop.wait()
    running.stop()


def run_tier_main(tier: str, start: Callable[[WorkerConfig], RunningTier], argv: list[str] | None) -> None:
    """``epd <tier>``: parse the worker config, start the tier, serve until signalled."""
    from epd.tier_cli import worker_config_from_args
    configure_logging()
    run_until_signalled(start(worker_config_from_args(tier, argv)))


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def abort_with(context: grpc.ServicerContext, err: EPDError) -> None:
    """End the call with the error's own status (``epd.errors`` maps it); raises, like ``context.abort``."""
    context.abort(err.grpc_status(), err.message)


def remaining_s(context: grpc.ServicerContext, default_s: float) -> float:
    """Seconds left on the caller's deadline, or ``default_s`` when the call has none."""
    left = context.time_remaining()
    return default_s if left is None else min(left, default_s)
