"""The router process: the OpenAI-compatible HTTP API (uvicorn) and the public gRPC API on one event
loop, over one ``RequestPipeline`` whose backend is the tiers (or, with ``--aggregated``, the whole
model in this process); plus, on a listener of its own (``admin_port``, with a token), the admin
endpoints launchers use to add and drain workers.

    epd router [--config router.yaml] [--encoders A,B --prefills C --decodes D] [RouterConfig flags]
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

import grpc
import uvicorn

from epd import loops
from epd.config import ConfigError, RouterConfig
from epd.router.pipeline import RequestPipeline
from epd.router.stats_log import StatsLog
from epd.server.flags import Command, OneLineParser, load, run_or_exit
from epd.server.parent import watch_parent
from epd.server.ports import PortTaken, check_router_ports, exit_if_taken
from epd.server.process import announce_ready, configure_logging, raise_open_files_limit

log = logging.getLogger("epd.router")


def router_command() -> Command:
    parser = OneLineParser(prog="epd router", description="run the router (HTTP + public gRPC)")
    parser.add_argument("--config", help="YAML with RouterConfig fields")
    return Command(parser).add(RouterConfig)


def router_config_from_args(argv: list[str] | None) -> RouterConfig:
    command = router_command()
    args = command.parse_args(argv)
    return load(RouterConfig, command, args, yaml_path=args.config, prog="epd router")


def build_pipeline(config: RouterConfig) -> RequestPipeline:
    """The pipeline over the backend the config asks for (blocking: the in-process one loads the model)."""
    from epd.models.locate import resolve_model
    from epd.router.media_fetch import FetchLimits, MediaFetcher

    model_dir = resolve_model(config.model)
    if config.aggregated:
        from epd.router.backends.in_process import InProcessBackend
        backend = InProcessBackend(model_dir, config.engine, stream_interval=config.stream_interval)
    else:
        from epd.router.backends.disaggregated import DisaggregatedBackend
        backend = DisaggregatedBackend(config, model_dir)
    media = MediaFetcher(allowed_local_media_path=config.allowed_local_media_path,
                         allow_private_network=config.allow_private_network,
                         allowed_media_domains=config.allowed_media_domains,
                         limits=FetchLimits(max_items=config.max_items_per_request))
    return RequestPipeline(model_dir, config, backend, media=media)


def build_admin_app(workers, model: str, tokens, planner=None):
    """The admin API (its own listener, never the public port): launchers and autoscalers register
    new workers and drain old ones, with an admin token (``ApiKeys``). A worker is registered only
    when it answers EPD's health RPC as the tier and model it claims: a stranger's address never
    gets users' images."""
    from fastapi import Body, FastAPI, Request
    from fastapi.responses import JSONResponse

    from epd.errors import Unauthenticated
    from epd.router.openai.responses import error_response

    app = FastAPI(title="EPD admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        try:
            tokens.check_bearer(request.headers.get("authorization"))
        except Unauthenticated as err:
            return error_response(err)
        return await call_next(request)

    @app.get("/admin/workers")
    async def list_workers():
        return {"workers": {tier: [w.as_dict() for w in states] for tier, states in workers.workers.items()}}

    @app.get("/admin/plan")
    async def plan():
        """The online planner's wanted workers per tier and its latest decisions (404 without one)."""
        if planner is None:
            return JSONResponse({"error": "no planner runs here (autoscale_budget is unset)"}, status_code=404)
        return planner.as_dict()

    @app.post("/admin/workers")
    async def add_worker(body: dict = Body(...)):
        try:
            worker = await workers.add(body["tier"], body["address"], expected_model=model)
        except (KeyError, ValueError) as err:
            return JSONResponse({"error": f"expected {{tier, address}} of a live EPD worker of model {model!r}: "
                                          f"{err}"}, status_code=400)
        return worker.as_dict()

    @app.delete("/admin/workers")
    async def remove_worker(body: dict = Body(...)):
        try:
            drained = await workers.remove(body["tier"], body["address"], float(body.get("drain_timeout_s", 60)))
        except (KeyError, StopIteration, ValueError) as err:
            return JSONResponse({"error": f"no such worker: {err}"}, status_code=404)
        return {"removed": body["address"], "drained": drained}

    return app


async def _start_admin(config: RouterConfig, router, planner=None):
    """The admin listener when ``admin_port`` is set (-> (uvicorn server, its task, its URL)), else None."""
    from epd.router.auth import ENV_ADMIN_TOKEN, ApiKeys

    if config.admin_port is None or not hasattr(router.backend, "workers"):
        return None
    tokens = ApiKeys((), config.admin_token_file, env_var=ENV_ADMIN_TOKEN)
    if not tokens.enabled:
        raise RuntimeError(f"router: admin_port is set but no admin token is ({ENV_ADMIN_TOKEN} or admin_token_file)")
    app = build_admin_app(router.backend.workers, config.model, tokens, planner)
    server = uvicorn.Server(uvicorn.Config(app, host=config.admin_host, port=config.admin_port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"router: cannot serve the admin API on {config.admin_host}:{config.admin_port} (taken?)")
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, f"http://{config.admin_host}:{port}"


def _planner(config: RouterConfig, router):
    """The online planner when ``autoscale_budget`` is set (tiers to plan: not the aggregated engine)."""
    if config.autoscale_budget is None:
        return None
    if not hasattr(router.backend, "workers"):
        raise ConfigError("autoscale_budget plans encoders, prefills and decodes; the aggregated engine has none")
    from epd.router.autoscale import PlannerLoop

    return PlannerLoop(config, router.backend.workers, router.metrics)


def key_rate_limiter(config: RouterConfig, api_keys):
    """The per-key rate limit, when set; it needs keys (no key: nothing to count requests by)."""
    from epd.router.rate_limit import KeyRateLimiter

    if config.api_key_requests_per_s is None:
        return None
    if not api_keys.enabled:
        raise ConfigError("api_key_requests_per_s limits each API key, but no API key is set (--api-key, "
                          "--api-key-file or EPD_API_KEY)")
    return KeyRateLimiter(config.api_key_requests_per_s, config.api_key_burst)


async def serve(config: RouterConfig, *, handle_signals: bool = True, on_ready=None, on_server=None) -> None:
    from epd.router.auth import ApiKeys
    from epd.router.body_limits import BodyLimits
    from epd.router.grpc_api import ApiKeyInterceptor, add_router_grpc, public_server_options
    from epd.router.openai.app import build_app

    raise_open_files_limit()  # a connection per streaming client
    api_keys = ApiKeys(config.api_keys, config.api_key_file)
    router = await asyncio.to_thread(build_pipeline, config)
    await router.start()
    rate_limiter = key_rate_limiter(config, api_keys)
    interceptors = [ApiKeyInterceptor(api_keys, protect_health=config.protect_health_and_metrics,
                                      rate_limiter=rate_limiter)] if api_keys.enabled else []
    limits = BodyLimits.from_config(config)
    grpc_server = grpc.aio.server(options=public_server_options(limits), interceptors=interceptors)
    add_router_grpc(grpc_server, router, default_max_tokens=config.default_max_tokens, limits=limits,
                    generation=router.generation)
    grpc_port = None
    if config.public_grpc:
        grpc_port = grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        if grpc_port == 0:  # taken since the check at start
            raise PortTaken(f"--grpc-port {config.grpc_port}: cannot bind {config.host}:{config.grpc_port} (in use?); "
                            "give --grpc-port another port, or 0 for a free one")
    await grpc_server.start()
    app = build_app(router, tokenizer=router.tokenizer, default_max_tokens=config.default_max_tokens,
                    generation=router.generation,
                    api_keys=api_keys, protect_health_and_metrics=config.protect_health_and_metrics,
                    limits=limits, rate_limiter=rate_limiter, allowed_origins=config.allowed_origins)
    planner = _planner(config, router)
    admin = await _start_admin(config, router, planner)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                                           timeout_graceful_shutdown=config.shutdown_grace_s))
    if on_server is not None:
        on_server(server)
    grpc_stopping: list[asyncio.Task] = []
    if handle_signals:
        loop = asyncio.get_running_loop()

        def stop(grace_s: float = config.shutdown_grace_s) -> None:
            """Both APIs stop taking requests now and finish what they stream, up to ``grace_s``."""
            server.should_exit = True
            server.force_exit = server.force_exit or grace_s == 0
            if not grpc_stopping:
                grpc_stopping.append(asyncio.ensure_future(grpc_server.stop(grace=grace_s)))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        # its launcher died: the clients' requests can not be finished by workers that go with it
        watch_parent(lambda: loop.call_soon_threadsafe(stop, 0.0))
    # a socket the launcher bound and shares between its routers: accepted on, never bound here
    sockets = [socket.socket(fileno=config.http_fd)] if config.http_fd is not None else None
    serving = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        http_port = server.servers[0].sockets[0].getsockname()[1]
        grpc_address = f"{config.host}:{grpc_port}" if grpc_port is not None else "none"
        announce_ready("router", f"http://{config.host}:{http_port}", f"grpc={grpc_address}",
                       *([f"admin={admin[2]}"] if admin else []))
        if on_ready is not None:  # (HTTP URL, gRPC address, admin URL or None)
            on_ready(f"http://{config.host}:{http_port}", grpc_address, admin[2] if admin else None)
    stats = None if config.disable_log_stats else asyncio.create_task(
        StatsLog(router).run(config.log_stats_interval_s))
    planning = asyncio.create_task(planner.run()) if planner is not None else None
    await serving
    for task in (stats, planning):
        if task is not None:
            task.cancel()
    if admin is not None:
        admin[0].should_exit = True
        await admin[1]
    await (grpc_stopping[0] if grpc_stopping else grpc_server.stop(grace=2))
    # HTTP requests still being read (uvicorn does not cancel them when it stops with no grace) are
    # cancelled on the tiers now, while the backend can still say so
    from epd.router.openai.streaming import stop_pumps
    await stop_pumps()
    await router.close()


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = run_or_exit("epd router", lambda: router_config_from_args(argv))
    configure_logging(config.log_level, config.log_format)
    from epd.router.auth import ApiKeys
    run_or_exit("epd router", lambda: key_rate_limiter(config, ApiKeys(config.api_keys, config.api_key_file)))
    exit_if_taken("epd router", lambda: check_router_ports(config))
    exit_if_taken("epd router", lambda: loops.run(serve(config)))
