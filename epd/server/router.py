"""The router process: the OpenAI-compatible HTTP API (uvicorn) and the public gRPC API on one event
loop, over one ``RequestPipeline`` whose backend is the tiers (or, with ``--aggregated``, the whole
model in this process); plus the admin endpoints launchers use to add and drain workers.

    epd router [--config router.yaml] [--encoders A,B --prefills C --decodes D] [RouterConfig flags]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
import uvicorn

from epd.config import RouterConfig
from epd.router.pipeline import RequestPipeline
from epd.rpc import SERVER_OPTIONS
from epd.server.flags import Command, load, run_or_exit
from epd.server.process import announce_ready, configure_logging, raise_open_files_limit

log = logging.getLogger("epd.router")


def router_command() -> Command:
    parser = argparse.ArgumentParser(prog="epd router", description="run the router (HTTP + public gRPC)")
    parser.add_argument("--config", help="YAML with RouterConfig fields")
    return Command(parser).add(RouterConfig)


def router_config_from_args(argv: list[str] | None) -> RouterConfig:
    command = router_command()
    args = command.parser.parse_args(argv)
    return load(RouterConfig, command, args, yaml_path=args.config, prog="epd router")


def build_pipeline(config: RouterConfig) -> RequestPipeline:
    """The pipeline over the backend the config asks for (blocking: the in-process one loads the model)."""
    from epd.models.presets import resolve_model
    from epd.router.media_fetch import FetchLimits, MediaFetcher

    model_dir = resolve_model(config.model)
    if config.aggregated:
        from epd.router.backends.in_process import InProcessBackend
        backend = InProcessBackend(model_dir, config.engine)
    else:
        from epd.router.backends.disaggregated import DisaggregatedBackend
        backend = DisaggregatedBackend(config, model_dir)
    media = MediaFetcher(allowed_local_media_path=config.allowed_local_media_path,
                         allow_private_network=config.allow_private_network,
                         limits=FetchLimits(max_items=config.max_items_per_request))
    return RequestPipeline(model_dir, config, backend, media=media)


def add_admin_routes(app, workers) -> None:
    """Scale a tier at run time: launchers (Ray, scripts) register new workers and drain old ones."""
    from fastapi import Body
    from fastapi.responses import JSONResponse

    @app.post("/admin/workers")
    async def add_worker(body: dict = Body(...)):
        try:
            worker = await workers.add(body["tier"], body["address"])
        except (KeyError, ValueError) as err:
            return JSONResponse({"error": f"expected {{tier, address}}: {err}"}, status_code=400)
        return worker.as_dict()

    @app.delete("/admin/workers")
    async def remove_worker(body: dict = Body(...)):
        try:
            drained = await workers.remove(body["tier"], body["address"], float(body.get("drain_timeout_s", 60)))
        except (KeyError, StopIteration, ValueError) as err:
            return JSONResponse({"error": f"no such worker: {err}"}, status_code=404)
        return {"removed": body["address"], "drained": drained}


async def serve(config: RouterConfig, *, handle_signals: bool = True, on_ready=None, on_server=None) -> None:
    from epd.router.grpc_api import add_router_grpc
    from epd.router.http_app import build_app

    raise_open_files_limit()  # a connection per streaming client
    router = await asyncio.to_thread(build_pipeline, config)
    await router.start()
    grpc_server = grpc.aio.server(options=SERVER_OPTIONS)
    add_router_grpc(grpc_server, router, default_max_tokens=config.default_max_tokens)
    grpc_port = grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    if grpc_port == 0:
        raise RuntimeError(f"router: cannot bind gRPC {config.host}:{config.grpc_port} (taken?)")
    await grpc_server.start()
    app = build_app(router, tokenizer=router.tokenizer, default_max_tokens=config.default_max_tokens)
    if hasattr(router.backend, "workers"):
        add_admin_routes(app, router.backend.workers)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    if on_server is not None:
        on_server(server)
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        http_port = server.servers[0].sockets[0].getsockname()[1]
        announce_ready("router", f"http://{config.host}:{http_port}", f"grpc={config.host}:{grpc_port}")
        if on_ready is not None:
            on_ready(f"http://{config.host}:{http_port}", f"{config.host}:{grpc_port}")
    await serving
    await grpc_server.stop(grace=2)
    await router.close()


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = run_or_exit("epd router", lambda: router_config_from_args(argv))
    asyncio.run(serve(config))
