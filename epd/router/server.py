"""The router process: OpenAI-compatible HTTP (uvicorn) and the public gRPC API on one event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
import uvicorn

from epd.config import RouterConfig, from_dict, load_yaml
from epd.router.pipeline import RequestPipeline
from epd.serving import GRPC_OPTIONS, READY_PREFIX, configure_logging

log = logging.getLogger("epd.router")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epd router", description="run the router (HTTP + public gRPC)")
    p.add_argument("--config", help="YAML with RouterConfig fields and optional http: {host, port, grpc_port}")
    p.add_argument("--model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    p.add_argument("--grpc-port", type=int, default=0, help="public gRPC port (0: pick a free one)")
    p.add_argument("--encoders", help="comma-separated encoder addresses")
    p.add_argument("--prefills", help="comma-separated prefill addresses")
    p.add_argument("--decodes", help="comma-separated decode addresses")
    p.add_argument("--allowed-local-media-path", help="serve file:// images only from under this directory")
    p.add_argument("--allow-private-network", action="store_true", help="let http(s) images come from private IPs")
    p.add_argument("--transport", help="tensor transport between tiers (default: automatic)")
    p.add_argument("--aggregated", action="store_true",
                   help="no tiers: run the whole model in this process (epd.aggregated)")
    return p.parse_args(argv)


def router_config(args: argparse.Namespace) -> RouterConfig:
    data = load_yaml(args.config) if args.config else {}
    data.pop("http", None)
    for tier in ("encoders", "prefills", "decodes"):
        if getattr(args, tier):
            data[tier] = [a for a in getattr(args, tier).split(",") if a]
    if args.model:
        data["model"] = args.model
    if args.transport:
        data["transport"] = args.transport
    return from_dict(RouterConfig, data)


def build_pipeline(args: argparse.Namespace, config: RouterConfig) -> RequestPipeline:
    """The pipeline over the backend the flags ask for (blocking: the in-process one loads the model)."""
    from epd.models.presets import resolve_model
    from epd.models.registry import family_for
    from epd.router.media_fetch import FetchLimits, MediaFetcher

    model_dir = resolve_model(config.model)
    if getattr(args, "aggregated", False):
        from epd.router.backends.in_process import InProcessBackend
        backend = InProcessBackend(model_dir)
    else:
        from epd.router.backends.disaggregated import DisaggregatedBackend
        row_bytes = family_for(model_dir).mm_spec(model_dir).embedding_dim * 4  # encoders emit float32 by default
        backend = DisaggregatedBackend(config, embedding_row_bytes=row_bytes)
    media = MediaFetcher(allowed_local_media_path=args.allowed_local_media_path,
                         allow_private_network=args.allow_private_network,
                         limits=FetchLimits(max_items=config.max_items_per_request))
    return RequestPipeline(model_dir, config, backend, media=media)


def add_admin_routes(app, router) -> None:
    """Scale a tier at run time: launchers (Ray, scripts) register new workers and drain old ones."""
    from fastapi import Body
    from fastapi.responses import JSONResponse

    @app.post("/admin/workers")
    async def add_worker(body: dict = Body(...)):
        try:
            worker = await router.workers.add(body["tier"], body["address"])
        except (KeyError, ValueError) as err:
            return JSONResponse({"error": f"expected {{tier, address}}: {err}"}, status_code=400)
        return worker.as_dict()

    @app.delete("/admin/workers")
    async def remove_worker(body: dict = Body(...)):
        try:
            drained = await router.workers.remove(body["tier"], body["address"],
                                                  float(body.get("drain_timeout_s", 60)))
        except (KeyError, StopIteration, ValueError) as err:
            return JSONResponse({"error": f"no such worker: {err}"}, status_code=404)
        return {"removed": body["address"], "drained": drained}


async def serve(args: argparse.Namespace, *, handle_signals: bool = True, on_ready=None, on_server=None) -> None:
    from epd.router.grpc_api import add_router_grpc
    from epd.router.http_app import build_app

    config = router_config(args)
    router = await asyncio.to_thread(build_pipeline, args, config)
    await router.start()
    grpc_server = grpc.aio.server(options=GRPC_OPTIONS)
    add_router_grpc(grpc_server, router)
    grpc_port = grpc_server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    await grpc_server.start()
    app = build_app(router, tokenizer=router.tokenizer)
    if hasattr(router.backend, "workers"):
        add_admin_routes(app, router.backend)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
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
        print(f"{READY_PREFIX} router http://{args.host}:{http_port} grpc={args.host}:{grpc_port}", flush=True)
        if on_ready is not None:
            on_ready(f"http://{args.host}:{http_port}", f"{args.host}:{grpc_port}")
    await serving
    await grpc_server.stop(grace=2)
    await router.close()


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
