"""What every tier process shares: a gRPC server on a host:port, a ready line on stdout that
launchers wait for, and a clean stop on SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from epd.config import WorkerConfig

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


def run_until_signalled(tier: str, address: str, server: grpc.Server, on_stop: Callable[[], None],
                        metrics=None, config: WorkerConfig | None = None) -> None:
    """Serve the tier's metrics, print the ready line, block until SIGTERM/SIGINT, then stop the
    server and the tier."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    extra = ""
    if metrics is not None and config is not None:
        extra = f" metrics=http://{config.host}:{metrics.serve(config.host, config.metrics_port)}/metrics"
    print(f"{READY_PREFIX} {tier} {address}{extra}", flush=True)
    stop.wait()
    logging.getLogger(tier).info("stopping %s at %s", tier, address)
    server.stop(grace=2).wait(5)
    on_stop()


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
