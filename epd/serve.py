"""``epd serve``: the embedded default. Starts each tier and the router as local processes on
loopback, waits until all are healthy, prints the URLs, and on Ctrl-C / SIGTERM stops every
process it started (workers clean their shared memory as they stop)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request

from epd.launch import LocalCluster


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epd serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen2-vl", help="preset name or HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="where the router listens")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    p.add_argument("--grpc-port", type=int, default=50051, help="port of the public gRPC API")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--transport", default="", help="inline | shm | cuda_ipc | nccl (default: automatic)")
    p.add_argument("--allowed-local-media-path", help="allow file:// images from under this directory")
    p.add_argument("--allow-private-network", action="store_true", help="let http(s) images come from private IPs")
    p.add_argument("--config", help="YAML with the router's settings (RouterConfig fields)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="how long to wait for everything to be healthy")
    p.add_argument("--threads-per-tier", type=int, default=None,
                   help="intra-op threads of each tier process (default: this host's cores split between them)")
    p.add_argument("--aggregated", action="store_true",
                   help="no tiers: one process runs the whole model behind the same API (the baseline)")
    p.add_argument("--launcher", choices=("local", "ray"), default="local",
                   help="local: child processes on this machine; ray: Ray actors (see deploy/ray/)")
    p.add_argument("--ray-address", help="an existing Ray cluster ('auto'); default: start a local one")
    p.add_argument("--ray-config", help="RayDeployment YAML (deploy/ray/cluster.yaml); CLI counts override it")
    return p.parse_args(argv)


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.launcher == "ray":
        serve_on_ray(args, stop)
        return
    counts = (0, 0, 0) if args.aggregated else (args.encoders, args.prefills, args.decodes)
    cluster = LocalCluster(args.model, num_encoders=counts[0], num_prefills=counts[1], num_decodes=counts[2],
                           transport=args.transport, threads_per_tier=args.threads_per_tier)
    try:
        what = "the aggregated engine (no tiers)" if args.aggregated else \
            f"{counts[0]} encoder(s), {counts[1]} prefill(s), {counts[2]} decode(s), " \
            f"{cluster.threads_per_tier or 'default'} thread(s) each"
        print(f"epd serve: starting {what} for {args.model} ...", flush=True)
        cluster.start(timeout_s=args.timeout_s)
        extra = ["--aggregated"] if args.aggregated else []
        if args.allowed_local_media_path:
            extra += ["--allowed-local-media-path", args.allowed_local_media_path]
        if args.allow_private_network:
            extra += ["--allow-private-network"]
        if args.config:
            extra += ["--config", args.config]
        router = cluster.start_router(host=args.host, port=args.port, grpc_port=args.grpc_port, extra_args=extra,
                                      timeout_s=args.timeout_s)
        url, grpc_address = router.ready_fields[0], router.ready_fields[1].removeprefix("grpc=")
        wait_healthy(url, args.timeout_s)
        print(f"epd serve: ready\n  OpenAI API  {url}/v1\n  gRPC API    {grpc_address}\n"
              f"  metrics     {url}/metrics\n  health      {url}/health\n(Ctrl-C stops everything)", flush=True)
        while not stop.is_set():
            dead = [p for p in cluster.processes if p.proc.poll() is not None]
            if dead:
                print(f"epd serve: {dead[0].tier} exited with {dead[0].proc.returncode}; stopping.\n"
                      f"{dead[0].tail()}", file=sys.stderr, flush=True)
                break
            stop.wait(0.5)
    finally:
        print("epd serve: stopping ...", flush=True)
        cluster.stop()
        print("epd serve: stopped", flush=True)


if __name__ == "__main__":
    main()


def serve_on_ray(args: argparse.Namespace, stop: threading.Event) -> None:
    import ray

    from epd.config import load_yaml
    from epd.deploy.ray_cluster import RayDeployment, RayEPDCluster

    data = load_yaml(args.ray_config) if args.ray_config else {}
    data.update(model=args.model, http_port=args.port, grpc_port=args.grpc_port, transport=args.transport)
    data.setdefault("host", "127.0.0.1" if args.ray_address is None else "node")
    tiers = data.setdefault("tiers", {})
    for tier, count in (("encoder", args.encoders), ("prefill", args.prefills), ("decode", args.decodes)):
        tiers.setdefault(tier, {})["replicas"] = count
    deployment = RayDeployment.from_dict(data)
    ray.init(address=args.ray_address, include_dashboard=False,
             **({} if args.ray_address else {"_node_ip_address": "127.0.0.1"}))
    cluster = RayEPDCluster(deployment)
    try:
        cluster.start(timeout_s=args.timeout_s)
        cluster.wait_healthy(args.timeout_s)
        print(f"epd serve (ray): ready\n  OpenAI API  {cluster.http_url}/v1\n  gRPC API    {cluster.grpc_address}\n"
              f"(Ctrl-C stops everything)", flush=True)
        stop.wait()
    finally:
        print("epd serve (ray): stopping ...", flush=True)
        cluster.stop()
        ray.shutdown()
