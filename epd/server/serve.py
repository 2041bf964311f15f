"""``epd serve``: the embedded default. Starts each tier and the router as local processes on
loopback (or as Ray actors with ``--launcher ray``), waits until all are healthy, prints the URLs,
and on Ctrl-C / SIGTERM stops every process it started (workers clean their shared memory as they
stop). A worker that dies meanwhile is restarted on its own port (``--max-restarts`` times, with a
growing delay) and its shared memory reclaimed; only the router's death stops the service. Its flags are the router's and the workers' own (``epd/server/flags.py``), so a setting has
one name everywhere; the validated configs reach the children as files.

    epd serve [--model M] [--encoders N --prefills N --decodes N] [--config router.yaml]
              [--worker-config worker.yaml] [any RouterConfig / WorkerConfig flag]
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

from epd.config import (
    ConfigError,
    EngineConfig,
    RouterConfig,
    ServeConfig,
    WorkerConfig,
    deep_merge,
    load_config,
    load_yaml,
)
from epd.router.auth import ENV_ADMIN_TOKEN, ApiKeys
from epd.server.flags import Command, OneLineParser, run_or_exit
from epd.server.mooncake import MooncakeStartError, MooncakeStore
from epd.server.parent import watch_parent

# set by the launcher for each worker, never by the user: where a worker listens
_WORKER_ASSIGNED = ("host", "port", "metrics_port")


def serve_command() -> Command:
    parser = OneLineParser(prog="epd serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                        help="the model, as --model (vLLM's `vllm serve MODEL`)")
    parser.add_argument("--config", help="YAML with the router's settings (RouterConfig fields)")
    parser.add_argument("--worker-config", help="YAML with every worker's settings (WorkerConfig fields)")
    command = Command(parser).add(ServeConfig, skip=("router", "worker"))
    # the router's engine is the workers' one (--aggregated copies it over): its flags are the workers'
    # (and what it sets on each of its routers itself: their shared socket, index, gRPC)
    command.add(RouterConfig, ("router",), skip=("encoders", "prefills", "decodes", "engine", "http_fd",
                                                 "router_index", "public_grpc"))
    return command.add(WorkerConfig, ("worker",), skip=_WORKER_ASSIGNED)


def serve_config_from_args(argv: list[str] | None) -> ServeConfig:
    command = serve_command()
    args = command.parse_args(argv)
    data = {"router": load_yaml(args.config) if args.config else {},
            "worker": load_yaml(args.worker_config) if args.worker_config else {}}
    overrides = command.overrides(args)
    if args.model_positional:
        given = overrides.get("router", {}).get("model")
        if given is not None and given != args.model_positional:
            raise ConfigError(f"command line: the model is given twice, {args.model_positional!r} and --model "
                              f"{given!r}; give it once")
        for part in ("router", "worker"):
            overrides.setdefault(part, {})["model"] = args.model_positional
    data = deep_merge(data, overrides)
    config = load_config(ServeConfig, data, source="command line")
    if config.routers > 1 and (config.router.aggregated or config.launcher == "ray"):
        raise ConfigError(f"command line: --routers {config.routers} with "
                          f"{'--aggregated (each router would run its own engine)' if config.router.aggregated else 'the Ray launcher (one router actor so far)'}; "
                          "use the local launcher's tiers")
    if config.router.aggregated and config.launcher == "ray":
        raise ConfigError("command line: aggregated runs the whole model in one process, without tiers to place; "
                          "use the local launcher")
    _check_tensor_parallel(config)
    config = _with_autoscale(config)
    if config.router.aggregated:  # the one process runs the engine the workers would have
        config = config.model_copy(update={"router": config.router.model_copy(update={"engine": config.worker.engine})})
    return config


def _with_autoscale(config: ServeConfig) -> ServeConfig:
    """``--autoscale-budget``: the tiers it can plan, a budget that holds the workers started, and
    the router's admin API on (a port of its own, on loopback unless set), which ``epd serve`` uses
    to carry the planner's decisions out."""
    budget = config.router.autoscale_budget
    if budget is None:
        return config
    if config.router.aggregated:
        raise ConfigError("command line: --autoscale-budget plans encoders, prefills and decodes; --aggregated runs "
                          "none (one engine)")
    if config.launcher == "ray":  # the Ray launcher turns the admin API on itself, and checks its own counts
        return config
    started = config.encoders + config.prefills + config.decodes
    if budget < started:
        raise ConfigError(f"command line: --autoscale-budget {budget} is less than the {started} workers started "
                          f"({config.encoders} encoder(s), {config.prefills} prefill(s), {config.decodes} decode(s))")
    if config.router.admin_port is not None:
        return config
    return config.model_copy(update={"router": config.router.model_copy(update={"admin_port": 0})})


def _check_tensor_parallel(config: ServeConfig) -> None:
    """Tensor-parallel sizes this launch can run, on the devices given, or one line saying what would."""
    engine = config.worker.engine
    if engine.tensor_parallel_devices:
        raise ConfigError("command line: --tensor-parallel-devices places one worker's ranks; epd serve places each "
                          "tier's with --prefill-gpus / --decode-gpus (worker i takes the next -tp of them)")
    if max(engine.tensor_parallel_size, config.prefill_tp or 1, config.decode_tp or 1) == 1:
        return
    if config.router.aggregated and (config.prefill_tp or config.decode_tp):
        raise ConfigError(f"command line: {'--prefill-tp' if config.prefill_tp else '--decode-tp'} with --aggregated, "
                          "which runs one engine: use --tensor-parallel-size")
    from epd.engine.tensor_parallel import check_runnable
    from epd.models.locate import resolve_model
    try:
        model_dir = resolve_model(config.router.model)
    except ValueError:
        return  # a hub id not fetched yet (fetch_model does it): each worker checks its size at its start
    for flag, placed in _placed_engines(config):
        try:
            check_runnable(model_dir, placed, flag)
        except ValueError as err:
            raise ConfigError(f"command line: {err}") from None


def _placed_engines(config: ServeConfig) -> list[tuple[str, EngineConfig]]:
    """(the flag that sized it, the engine config) of each differently placed tensor-parallel
    engine this launch starts: the aggregated one, or each tier's workers on their devices."""
    from epd.server.gpu_sharing import rank_devices

    engine = config.worker.engine
    if config.router.aggregated:
        return [("--tensor-parallel-size", engine)]
    placed = []
    for tier in ("prefill", "decode"):
        size = config.tensor_parallel_size(tier)
        if size == 1:
            continue
        flag = f"--{tier}-tp" if getattr(config, f"{tier}_tp") else "--tensor-parallel-size"
        try:
            groups = sorted(set(config.devices(tier))) or [None]
        except ValueError as err:
            raise ConfigError(f"command line: {err}") from None
        for group in groups:
            update: dict = {"tensor_parallel_size": size}
            if config.launcher == "ray":  # Ray gives each actor its GPUs where it places it: the cut is checked here
                update["device"] = "cpu"
            elif group is not None:
                ranks = rank_devices(group)
                update.update(device=ranks[0], tensor_parallel_devices=[d.partition(":")[2] for d in ranks])
            try:
                placed.append((flag, EngineConfig.model_validate({**engine.model_dump(exclude_unset=True), **update})))
            except ValueError as err:  # e.g. two ranks on one GPU: one line, not a traceback
                why = err.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(err, "errors") else str(err)
                raise ConfigError(f"command line: --{tier}-gpus: {why}") from None
    return placed


def fetch_model(config: ServeConfig) -> ServeConfig:
    """A hub id is found in the cache, or downloaded here once (huggingface_hub's progress bars)
    before any process starts; every process is then given its snapshot directory, and clients
    keep calling the model by the id (the served name, unless --served-model-name says another)."""

    from epd.models.locate import looks_like_a_hub_id, resolve_model

    model = config.router.model
    if not looks_like_a_hub_id(model) or Path(model).expanduser().exists():
        if config.revision or config.download_dir:
            raise ConfigError(f"command line: --revision / --download-dir apply to a hub id (like Qwen/Qwen2-VL-2B-"
                              f"Instruct); {model!r} is a directory or a preset")
        return config
    try:
        path = str(resolve_model(model, revision=config.revision, download_dir=config.download_dir, download=True))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    names = config.router.served_model_name or (model,)
    update = {"model": path, "served_model_name": names}
    return config.model_copy(update={"router": config.router.model_copy(update=update),
                                     "worker": config.worker.model_copy(update=update)})


def _tier_args(config: ServeConfig) -> dict[str, list[str]]:
    """Each tier's own tensor-parallel size (the workers share one config file)."""
    return {tier: ["--tensor-parallel-size", str(config.tensor_parallel_size(tier))]
            for tier in ("encoder", "prefill", "decode") if config.tensor_parallel_size(tier) > 1}


def wait_healthy(url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                body = json.loads(resp.read())
                if body.get("status") == "ok":
                    return body
                last = body
        except OSError as err:
            last = str(err)
        time.sleep(0.2)
    raise RuntimeError(f"the cluster did not become healthy within {timeout_s:.0f} s; last answer: {last}")


class StopRequested(Exception):
    """SIGTERM / SIGINT (or the launcher's end) came while the cluster was starting."""


class _Stopper:
    """What SIGTERM and SIGINT do: set ``event`` (the running cluster then stops and cleans up);
    while the cluster is still starting (``interrupting``), also raise ``StopRequested`` there, so a
    start that waits on a process (up to ``--timeout-s``) is not waited out first."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._starting = False

    def __call__(self, *_) -> None:
        self.event.set()
        if self._starting:
            self._starting = False
            raise StopRequested()

    @contextlib.contextmanager
    def interrupting(self):
        self._starting = not self.event.is_set()
        if not self._starting:
            raise StopRequested()
        try:
            yield
        finally:
            self._starting = False


def main(argv: list[str] | None = None) -> int:
    config = run_or_exit("epd serve", lambda: serve_config_from_args(argv))
    stopper = _Stopper()
    stop = stopper.event
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopper)
    # started by another EPD program (a benchmark, ``epd profile``): its end is our SIGTERM, so a
    # measurement killed midway leaves no cluster behind (nobody would stop it: its session is its own)
    watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))
    if config.launcher == "ray":
        from epd.server.ray import serve_on_ray
        from epd.server.ray_sizing import SizingError
        config = run_or_exit("epd serve", lambda: fetch_model(config))
        try:
            with encoder_cache_store(config) as config:
                serve_on_ray(config, stop)
        except (SizingError, MooncakeStartError) as err:  # one line naming what is wrong, not a traceback
            print(f"epd serve: error: {err}", file=sys.stderr, flush=True)
            return 1
        return 0
    from epd.server.ports import check_serve_ports, exit_if_taken
    exit_if_taken("epd serve", lambda: check_serve_ports(config))  # before anything starts
    config = run_or_exit("epd serve", lambda: fetch_model(config))
    try:
        with encoder_cache_store(config) as config:
            return serve_locally(config, stopper)
    except MooncakeStartError as err:
        print(f"epd serve: error: {err}", file=sys.stderr, flush=True)
        return 1


@contextlib.contextmanager
def encoder_cache_store(config: ServeConfig):
    """``config`` with its encoders pointed at the cluster's encoder cache store: for
    ``--encoder-cache-store mooncake`` without ``--mooncake-master``, a store started here on the
    workers' host (master and segment server, ``--encoder-cache-store-bytes``), stopped at exit."""
    encoder = config.worker.encoder
    if encoder.encoder_cache_store != "mooncake" or encoder.mooncake_master is not None:
        yield config
        return
    if config.launcher == "ray" and config.ray_address is not None:
        raise MooncakeStartError("--encoder-cache-store mooncake on an existing Ray cluster: give the cluster's "
                                 "--mooncake-master HOST:PORT (a store started here would be this host's only)")
    print(f"epd serve: starting the encoder cache store (Mooncake, {config.encoder_cache_store_bytes / 2**20:.0f} "
          "MiB) ...", flush=True)
    with MooncakeStore(segment_bytes=config.encoder_cache_store_bytes, host=config.worker.host) as store:
        print(f"epd serve: encoder cache store: Mooncake master {store.master} (pid {store.procs[0].pid}), segment "
              f"server pid {store.procs[1].pid}", flush=True)
        worker = config.worker.model_copy(update={
            "encoder": encoder.model_copy(update={"mooncake_master": store.master})})
        yield config.model_copy(update={"worker": worker})


def serve_locally(config: ServeConfig, stopper: _Stopper) -> int:
    """-> the exit code: 0 when stopped (during the start too), 1 when the router died."""
    from epd.progress import StartProgress
    from epd.server.local import LocalCluster

    router = config.router
    counts = (0, 0, 0) if router.aggregated else (config.encoders, config.prefills, config.decodes)
    progress = StartProgress(sum(counts) + config.routers, _print_line)  # the workers and the routers
    cluster = LocalCluster(router.model, num_encoders=counts[0], num_prefills=counts[1], num_decodes=counts[2],
                           transport=config.worker.transport, threads_per_tier=config.threads_per_tier,
                           worker_config=_one_rank(config.worker), tier_args=_tier_args(config),
                           zygote=config.standby,
                           devices={tier: config.devices(tier) for tier in ("encoder", "prefill", "decode")},
                           echo=_print_line, on_ready=progress.process_ready)
    try:
        what = "the aggregated engine (no tiers)" if router.aggregated else \
            f"{counts[0]} encoder(s), {counts[1]} prefill(s), {counts[2]} decode(s), " \
            f"{cluster.threads_per_tier or 'default'} thread(s) each"
        _print_line(f"epd serve: starting {what} for {router.model} ...")
        token = admin_token(config.router)
        plans = router_plans(config, {ENV_ADMIN_TOKEN: token} if token else {})
        try:  # the routers need the workers' addresses (their code was imported by the zygote meanwhile)
            with stopper.interrupting():
                cluster.start(timeout_s=config.timeout_s)
                routers = [cluster.start_router(**plan) for plan in plans]
        except StopRequested:
            _print_line("epd serve: stopped while starting")
            return 0
        finally:
            if (listener := plans[0].get("http_socket")) is not None:
                listener.close()  # the routers hold it now
        process = routers[0]
        url, grpc_address = process.ready_fields[0], process.ready_fields[1].removeprefix("grpc=")
        admin = "".join(f"  admin API   {field.removeprefix('admin=')}/admin/workers (needs the admin token)\n"
                        for field in process.ready_fields[2:] if field.startswith("admin="))
        wait_healthy(url, config.timeout_s)
        progress.finish()
        workers = "".join(f"  {p.tier:<11} {p.address} (pid {p.proc.pid}){_metrics_of(p)}\n"
                          for p in cluster.processes if p.tier != "router")
        _print_line(f"epd serve: ready\n  OpenAI API  {url}/v1\n  gRPC API    {grpc_address}\n"
                    f"  metrics     {url}/metrics\n  health      {url}/health\n{admin}"
                    + "".join(f"  router      {url} (pid {p.proc.pid})\n" for p in routers) +
                    f"{workers}(Ctrl-C stops everything)")
        scaler = None
        if router.autoscale_budget is not None:
            from epd.server.autoscale import LocalScaler
            admin_url = next(f.removeprefix("admin=") for f in process.ready_fields if f.startswith("admin="))
            scaler = LocalScaler(cluster, admin_url, token)
        return 0 if supervise(cluster, routers, config.max_restarts, stopper.event, scaler) else 1
    finally:
        _print_line("epd serve: stopping ...")
        cluster.stop()
        _print_line("epd serve: stopped")


def admin_token(router) -> str | None:
    """The router's admin token when ``epd serve`` must speak to its admin API (to carry out the
    planner's decisions): one of those given (EPD_ADMIN_TOKEN, admin_token_file: read as the router
    reads them), else one made here and handed to the router alone. None when no admin API is needed."""
    if router.autoscale_budget is None:
        return None
    return ApiKeys((), router.admin_token_file, env_var=ENV_ADMIN_TOKEN).first() or secrets.token_urlsafe(32)


def router_plans(config: ServeConfig, env: dict[str, str] | None = None) -> list[dict]:
    """Each router's ``start_router`` arguments: the router, or ``--routers N`` of them on one HTTP
    socket bound here once (each accepts on it: the kernel spreads the connections; no other
    process can join the port, as it could with SO_REUSEPORT). The first also serves gRPC and the
    admin API: gRPC's Python server cannot accept on a socket it did not bind. The caller closes
    the socket (``plans[0]["http_socket"]``) once the routers hold it."""
    router = config.router
    if config.routers == 1:
        return [dict(host=router.host, port=router.port, grpc_port=router.grpc_port, timeout_s=config.timeout_s,
                     config=router, env=env)]
    listener = socket.create_server((router.host, router.port), backlog=2048)
    plans = []
    for index in range(config.routers):
        own = router.model_copy(update={"router_index": index, "public_grpc": index == 0,
                                        "admin_port": router.admin_port if index == 0 else None,
                                        # one planner: the first router's (it has the admin API)
                                        "autoscale_budget": router.autoscale_budget if index == 0 else None})
        plans.append(dict(host=router.host, port=listener.getsockname()[1],
                          grpc_port=router.grpc_port if index == 0 else 0, timeout_s=config.timeout_s, config=own,
                          http_socket=listener, env=env if index == 0 else None))
    return plans


def _print_line(line: str) -> None:
    """A process's output line as it comes (its weights loading, its warnings, its stats), as vLLM
    shows its engine's: prefixed with who wrote it. An output nobody reads any more (the terminal
    or the pipe gone) is not a reason to stop serving, nor to skip stopping what was started."""
    try:
        print(line, flush=True)
    except OSError:  # BrokenPipeError, EIO of a closed terminal
        pass


def _one_rank(worker: WorkerConfig) -> WorkerConfig:
    """The config every worker starts from, at one rank: the encoders' (a vision tower is not cut)
    and the default of the tiers that get their own size as a flag (``_tier_args``)."""
    return worker.model_copy(update={"engine": worker.engine.model_copy(update={"tensor_parallel_size": 1})})


def _metrics_of(process) -> str:
    """`` metrics URL`` for a worker's banner line: each worker serves its own /metrics."""
    return "".join(f" metrics {f.removeprefix('metrics=')}" for f in process.ready_fields if f.startswith("metrics="))


def supervise(cluster, routers: list, max_restarts: int, stop: threading.Event, scaler=None) -> bool:
    """Until ``stop`` (-> True): a worker that dies is restarted (``LocalCluster.supervise``); the
    router's death ends the service (-> False), since it holds every request's state: its clients'
    connections went with it, and a new router would know none of their requests. Exiting non-zero
    lets whatever runs ``epd serve`` (systemd, a container runtime) restart the whole service."""
    while not stop.is_set():
        if router := next((r for r in routers if r.proc.poll() is not None), None):
            print(f"epd serve: the router (pid {router.proc.pid}) exited with {router.proc.returncode}; stopping."
                  f"\n{router.tail()}", file=sys.stderr, flush=True)
            return False
        for event in cluster.supervise(max_restarts):
            print(f"epd serve: {event}", file=sys.stderr, flush=True)
        for event in scaler.reconcile() if scaler is not None else ():  # the planner's decisions, carried out
            print(f"epd serve: {event}", flush=True)
        stop.wait(0.5)
    return True
