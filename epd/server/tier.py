"""The scaffold every tier process runs in: bind the gRPC server (a taken port is an error, never a
shared one), reclaim what a previous life of a producer left in /dev/shm, give producers a
TensorStore with its lease sweeper, serve Prometheus metrics, add the tier's servicer, start, and
print the ready line; on SIGTERM stop in order. A tier module only builds its servicer and says
what to close: ``build(ctx: TierContext) -> (add_to_server(server), close())``.

The server is grpc.aio on its own event loop thread: tier handlers are coroutines that await the
engine thread's results, so a request in flight costs no thread and health never waits behind
requests. Blocking work (tensor imports and exports, lease calls) runs on ``ctx.io``, a small pool
that nothing waits on for long. The TensorStore service stays synchronous on that pool: its calls
are short and never wait for another request.

    epd encoder|prefill|decode [--config worker.yaml] [--port 0] [flags from WorkerConfig]
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from epd.config import ConfigError, WorkerConfig
from epd.server.admission import TierAdmission
from epd.server.flags import Command, OneLineParser, load, run_or_exit
from epd.server.metrics import TierMetrics
from epd.server.process import (
    Stop,
    announce_ready,
    configure_logging,
    raise_open_files_limit,
    stop_engine_lost,
    wait_for_stop,
)
from epd.transport import TensorStore, add_tensor_store, cleanup_stale_segments
from epd.transport.choose import local_host_id
from epd.v1 import common_pb2
from epd.wire.rpc import AioServerThread
from epd.wire.tls import MutualTls, use_for_process

log = logging.getLogger("epd.server")
T = TypeVar("T")
_DRAIN_NOTICE_S = 2.0  # how long a stopping worker answers DRAINING at least

# tier -> (module with build(ctx), whether it exports tensors: those get a TensorStore)
_TIERS = {"encoder": ("epd.encoder.servicer", True), "prefill": ("epd.prefill.servicer", True),
          "decode": ("epd.decode.servicer", False)}
# worker flags a tier does not take (their settings belong to other tiers)
_SKIPPED = {"encoder": ("engine", "overlap_prefill_with_encode", "stream_port"), "prefill": ("encoder", "stream_port"),
            "decode": ("encoder", "overlap_prefill_with_encode")}


@dataclass
class TierContext:
    """What the scaffold gives a tier's ``build``."""

    tier: str
    config: WorkerConfig
    address: str  # host:port the server is bound to (the port is final)
    metrics: TierMetrics
    store: TensorStore | None  # for producers (they export tensors); None for decode
    io: ThreadPoolExecutor  # blocking transfer work, off the event loop
    admission: TierAdmission
    server: AioServerThread | None = None  # its loop runs the servicers (and what else a tier listens on)
    tls: MutualTls | None = None  # this worker's identity, for listeners other than gRPC
    # what an engine that can never step again calls (a tensor-parallel rank lost): the process stops
    on_engine_lost: Callable[[str], None] | None = None

    @property
    def host_id(self) -> str:
        """Whose shared memory this worker sees (what a consumer's ``host_id`` is compared with)."""
        return self.config.host_id or local_host_id()

    def health(self, **fields) -> common_pb2.HealthResponse:
        """This worker's health answer: what every tier says, plus its own ``fields``."""
        return common_pb2.HealthResponse(status=self.admission.health_status, tier=self.tier, model=self.config.model,
                                         num_held_requests=self.admission.num_requests, host_id=self.host_id,
                                         **fields)

    async def warm_grammar(self, engine, sampling) -> None:
        """A request with structured output: the engine's grammar compiler gets its tokenizer (loaded
        at the first grammar) here, on ``io``, not on the engine loop, where loading it would stall
        every running request for a second."""
        if sampling.structured is not None and engine.grammar_compiler is not None:
            await self.blocking(engine.grammar_compiler.tokenizer_view)

    async def blocking(self, fn: Callable[[], T], *, undo: Callable[[T], None] | None = None) -> T:
        """Run ``fn`` on ``io``. A caller cancelled meanwhile does not stop ``fn``: ``undo(result)``
        runs once it is done (release what it made: a lease nobody will hand on). ``undo`` runs on
        the event loop: it must not block (no remote call; ``release_soon``, not ``release``)."""
        future = asyncio.get_running_loop().run_in_executor(self.io, fn)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if undo is not None:
                future.add_done_callback(lambda f: undo(f.result()) if not f.cancelled() and f.exception() is None
                                         else None)
            raise


@dataclass
class RunningTier:
    """A started tier in this process (a tier main, or a Ray actor)."""

    tier: str
    server: AioServerThread
    address: str
    metrics_url: str
    on_stop: Callable[[], None]
    admission: TierAdmission | None = None

    def drain(self, timeout_s: float, notice_s: float = _DRAIN_NOTICE_S) -> bool:
        """Take no new request (health says DRAINING: routers stop sending and move on) and wait up
        to ``timeout_s`` for the held ones to finish, answering DRAINING for at least ``notice_s``.
        Returns whether they all did."""
        if self.admission is None:
            return True
        self.admission.draining = True
        log.info("%s at %s draining: %d request(s) held", self.tier, self.address, self.admission.num_requests)
        start = time.monotonic()
        deadline = start + timeout_s
        while self.admission.num_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        # answer DRAINING long enough for every router's health check to see it (they poll about
        # once a second): a router that knows lets the calls it is still reading end on their own
        # instead of moving them when this process goes
        time.sleep(max(0.0, min(notice_s, deadline - time.monotonic()) - (time.monotonic() - start)))
        return self.admission.num_requests == 0

    def stop(self, grace_s: float = 2.0) -> None:
        log.info("stopping %s at %s", self.tier, self.address)
        self.server.stop(grace_s=grace_s)
        self.on_stop()


def start_tier(tier: str, config: WorkerConfig) -> RunningTier:
    module_name, exports = _TIERS[tier]
    raise_open_files_limit()
    tls = MutualTls.from_config(config.tls)
    use_for_process(tls)  # this process's channels to other tiers (pushes, tensor fetches) present its certificate
    if exports:
        cleanup_stale_segments()  # a restarted producer reclaims what its previous life left behind
    server = AioServerThread(f"{tier}-grpc")
    io = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix=f"{tier}-io")
    store, close = None, (lambda: None)
    try:
        # bound before the model loads: a taken port fails fast, and the store knows its address
        port = server.bind(f"{config.host}:{config.port}", migration_pool=io, tls=tls)
        address = f"{config.host}:{port}"
        metrics = TierMetrics(tier, config.public_model_name)
        if exports:
            store = TensorStore(address=address)
            store.start_sweeper()
            metrics.watch_store(store)
        admission = TierAdmission(tier, config.max_requests, config.max_imported_bytes)
        add_to_server, close = importlib.import_module(module_name).build(
            TierContext(tier, config, address, metrics, store, io, admission, server, tls, stop_engine_lost))

        def add_servicers(grpc_server) -> None:
            if store is not None:
                add_tensor_store(grpc_server, store)
            add_to_server(grpc_server)

        server.start(add_servicers)
        metrics_url = f"http://{config.host}:{metrics.serve(config.host, config.metrics_port)}/metrics"
    except BaseException:
        server.stop(grace_s=0)
        close()
        io.shutdown(wait=False)
        if store is not None:
            store.close()
        raise

    def on_stop() -> None:
        close()
        io.shutdown(wait=True, cancel_futures=True)
        if store is not None:
            store.close()  # unlinks every segment this worker made

    return RunningTier(tier, server, address, metrics_url, on_stop, admission)


def tier_command(tier: str) -> Command:
    parser = OneLineParser(prog=f"epd {tier}", description=f"run one {tier} worker")
    parser.add_argument("--config", help="YAML with WorkerConfig fields (engine: {...}, encoder: {...} nested)")
    return Command(parser).add(WorkerConfig, skip=_SKIPPED[tier])


def worker_config_from_args(tier: str, argv: list[str] | None) -> WorkerConfig:
    command = tier_command(tier)
    args = command.parse_args(argv)
    config = load(WorkerConfig, command, args, yaml_path=args.config, prog=f"epd {tier}")
    if tier == "encoder" and config.engine.tensor_parallel_size > 1:
        raise ConfigError(f"tensor_parallel_size {config.engine.tensor_parallel_size}: an encoder is not cut into "
                          "ranks (its vision tower stays whole; encoders scale by replicas); use 1")
    if config.engine.tensor_parallel_size > 1:
        from epd.engine.tensor_parallel import check_runnable
        from epd.models.locate import resolve_model
        try:
            check_runnable(resolve_model(config.model), config.engine)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return config


def main(tier: str, argv: list[str] | None = None) -> None:
    """``epd <tier>``: start the tier, print the ready line, serve until SIGTERM/SIGINT or the death
    of its launcher. SIGTERM (a supervisor's: Kubernetes, Ray) drains: the held requests finish, and
    health answers DRAINING for a while so that every router sees it; SIGINT (Ctrl-C, or a launcher
    that stopped the router first: nobody is left to watch) drains without that notice. A launcher's
    death stops it at once: no router is left to take what a drain would finish."""
    configure_logging()
    config = run_or_exit(f"epd {tier}", lambda: worker_config_from_args(tier, argv))
    configure_logging(config.log_level, config.log_format)
    running = start_tier(tier, config)
    announce_ready(tier, running.address, f"metrics={running.metrics_url}")
    how = wait_for_stop()
    if how in (Stop.PARENT_GONE, Stop.ENGINE_LOST):
        running.stop(grace_s=0)  # its shared memory is unlinked on the way out (on_stop)
        if how is Stop.ENGINE_LOST:
            raise SystemExit(3)  # not a stop anyone asked for: a supervisor starts it again
        return
    if not running.drain(config.drain_timeout_s, _DRAIN_NOTICE_S if how is Stop.TERM else 0.0):
        log.warning("%s still held requests after %.0f s of draining; stopping anyway", tier, config.drain_timeout_s)
    running.stop()
