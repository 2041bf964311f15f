"""EPD on Ray (``epd serve --launcher ray``): each tier worker and the router are Ray actors. Ray
places them (per-tier CPUs, GPUs, custom resources), restarts them when they die
(``max_restarts``) and scales a tier at run time; the workers still talk gRPC and move tensors
as handles. The deployment is ``epd.config.RayDeployment``.

A worker keeps its port across restarts (ports are assigned once, by the launcher), so the
router's address list stays valid: a dead worker drops out of rotation at the next health check
and returns when Ray has restarted it.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import threading
import time
import urllib.request

import ray

from epd.config import TIERS, RayDeployment, RouterConfig, ServeConfig, WorkerConfig, deep_merge, load_config, load_yaml
from epd.server.ray_sizing import ROUTER_CPUS, SizingError, demand_breakdown, check_fits, fit_local


@ray.remote
class TierActor:
    """One encoder/prefill/decode worker, serving gRPC from inside the actor process."""

    def __init__(self, tier: str, config: WorkerConfig) -> None:
        from epd.server.tier import start_tier
        self.running = start_tier(tier, config)

    def address(self) -> str:
        return self.running.address

    def metrics_url(self) -> str:
        return self.running.metrics_url

    def pid(self) -> int:
        import os
        return os.getpid()

    def stop(self) -> None:
        self.running.stop()


@ray.remote
class RouterActor:
    """The router (HTTP + public gRPC) on its own event loop thread inside the actor."""

    def __init__(self, config: RouterConfig, admin_token: str) -> None:
        import os

        from epd.router.auth import ENV_ADMIN_TOKEN
        from epd.server.router import serve
        os.environ[ENV_ADMIN_TOKEN] = admin_token  # the actor's own process: never in a config or a log
        self._urls: tuple[str, str, str] | None = None
        self._server = None
        ready = threading.Event()

        def run() -> None:
            asyncio.run(serve(config, handle_signals=False,
                              on_ready=lambda h, g, a: (setattr(self, "_urls", (h, g, a)), ready.set()),
                              on_server=lambda s: setattr(self, "_server", s)))
            ready.set()

        threading.Thread(target=run, name="router", daemon=True).start()
        if not ready.wait(300) or self._urls is None:
            raise RuntimeError("router did not start")

    def urls(self) -> tuple[str, str, str]:
        """(HTTP base URL, public gRPC address, admin API URL)"""
        return self._urls

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True


class RayEPDCluster:
    def __init__(self, deployment: RayDeployment) -> None:
        self.d = deployment
        self.actors: dict[str, list] = {t: [] for t in TIERS}
        self.addresses: dict[str, list[str]] = {t: [] for t in TIERS}
        self.router = None
        self.http_url = self.grpc_address = self.admin_url = None
        self._admin_token = secrets.token_urlsafe(32)
        self._group = None  # placement group that packs prefill and decode workers on one node
        self._group_next = 0

    def start(self, timeout_s: float = 300.0) -> "RayEPDCluster":
        """Place every actor and wait for them; a deployment the cluster cannot hold is a
        ``SizingError`` before anything is placed, never an actor pending forever."""
        check_fits(self.d, [node["Resources"] for node in ray.nodes() if node.get("Alive")])
        if self.d.colocate_prefill_decode:
            self._make_colocation_group(timeout_s)
        for tier in TIERS:
            for _ in range(self.d.tiers[tier].replicas):
                self._add_worker(tier)
        self._wait_workers(timeout_s)
        self._start_router(timeout_s)
        return self

    def _make_colocation_group(self, timeout_s: float) -> None:
        """STRICT_PACK: every prefill and decode bundle on one node, so KV can move by CUDA IPC/shm."""
        from ray.util.placement_group import placement_group
        bundles = []
        for tier in ("prefill", "decode"):
            spec = self.d.tiers[tier]
            bundle = {"CPU": spec.num_cpus, **({"GPU": spec.num_gpus} if spec.num_gpus else {}), **spec.resources}
            bundles += [bundle] * spec.replicas
        self._group, self._group_size = placement_group(bundles, strategy="STRICT_PACK"), len(bundles)
        ray.get(self._group.ready(), timeout=timeout_s)

    def _host(self) -> str:
        return ray.util.get_node_ip_address() if self.d.host == "node" else self.d.host

    def _add_worker(self, tier: str):
        spec = self.d.tiers[tier]
        host = self._host()
        config = spec.config.model_copy(update={"model": self.d.model, "host": host, "port": _free_port(host),
                                                 "transport": self.d.transport,
                                                 "served_model_name": spec.config.served_model_name
                                                 or self.d.router.served_model_name})
        options = dict(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
                       max_restarts=spec.max_restarts, max_task_retries=spec.max_restarts)
        if self._group is not None and tier in ("prefill", "decode") and self._group_next < self._group_size:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=self._group_next)
            self._group_next += 1
        actor = TierActor.options(**options).remote(tier, config)
        self.actors[tier].append(actor)
        self.addresses[tier].append(f"{host}:{config.port}")
        return actor

    def _wait_workers(self, timeout_s: float) -> None:
        refs = [a.address.remote() for tier in TIERS for a in self.actors[tier]]
        try:
            ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            raise SizingError(f"{len(refs) - len(ready)} of {len(refs)} worker actors were not running after "
                              f"{timeout_s:.0f} s ({demand_breakdown(self.d)}; the cluster has "
                              f"{ray.cluster_resources()}, free {ray.available_resources()})") from None

    def _start_router(self, timeout_s: float) -> None:
        config = self.d.router.model_copy(update={
            # the admin API (scaling) on a free port of the router's host, with a token made for this cluster
            "admin_port": 0, "admin_host": self._host(),
            "model": self.d.model, "host": self._host(), "port": self.d.http_port, "grpc_port": self.d.grpc_port,
            "transport": self.d.transport, **{f"{tier}s": tuple(self.addresses[tier]) for tier in TIERS}})
        self.router = RouterActor.options(num_cpus=ROUTER_CPUS, max_restarts=3).remote(config, self._admin_token)
        self.http_url, self.grpc_address, self.admin_url = ray.get(self.router.urls.remote(), timeout=timeout_s)

    # ---- run-time scaling --------------------------------------------------------------------------
    def scale(self, tier: str, replicas: int, timeout_s: float = 300.0) -> None:
        """Add workers (they register with the router) or remove the newest (drained first)."""
        while len(self.actors[tier]) < replicas:
            actor = self._add_worker(tier)
            ray.get(actor.address.remote(), timeout=timeout_s)
            self._admin("POST", {"tier": tier, "address": self.addresses[tier][-1]})
        while len(self.actors[tier]) > replicas:
            address, actor = self.addresses[tier].pop(), self.actors[tier].pop()
            self._admin("DELETE", {"tier": tier, "address": address, "drain_timeout_s": 60})
            ray.kill(actor, no_restart=True)

    def _admin(self, method: str, body: dict) -> dict:
        req = urllib.request.Request(f"{self.admin_url}/admin/workers", data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self._admin_token}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.http_url}/health", timeout=10) as resp:
            return json.loads(resp.read())

    def wait_healthy(self, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                health = self.health()
                if health["status"] == "ok" and all(w["healthy"] for ws in health["workers"].values() for w in ws):
                    return health
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        for actor in ([self.router] if self.router else []) + [a for t in TIERS for a in self.actors[t]]:
            try:
                ray.get(actor.stop.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - already dead: kill below anyway
                pass
            ray.kill(actor, no_restart=True)
        self.actors = {t: [] for t in TIERS}
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._group)
            self._group = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_on_ray(config: ServeConfig, stop: threading.Event) -> None:
    """``epd serve --launcher ray``."""
    deployment = deployment_from(config)
    ray.init(address=config.ray_address, include_dashboard=False,
             **({} if config.ray_address else {"_node_ip_address": "127.0.0.1"}))
    for sig in (signal.SIGTERM, signal.SIGINT):  # ray.init installs its own, which kill the driver at once
        signal.signal(sig, lambda *_: stop.set())
    if config.ray_address is None:  # the one-node Ray started here: the tiers share its CPUs
        deployment = fit_local(deployment, ray.cluster_resources().get("CPU", 0.0))
    cluster = RayEPDCluster(deployment)
    try:
        cluster.start(timeout_s=config.timeout_s)
        cluster.wait_healthy(config.timeout_s)
        print(f"epd serve (ray): ready\n  OpenAI API  {cluster.http_url}/v1\n  gRPC API    {cluster.grpc_address}\n"
              f"(Ctrl-C stops everything)", flush=True)
        stop.wait()
    finally:
        print("epd serve (ray): stopping ...", flush=True)
        cluster.stop()
        ray.shutdown()


def deployment_from(config: ServeConfig) -> RayDeployment:
    """The deployment from ``--ray-config`` with what the command line set on top: model, ports,
    transport, router settings, tier counts, and worker settings for every tier."""
    data = load_yaml(config.ray_config) if config.ray_config else {}
    given = config.model_dump(exclude_defaults=True)  # only what the command line (or its files) set wins
    router, worker = given.get("router", {}), given.get("worker", {})
    for key, target in (("model", "model"), ("port", "http_port"), ("grpc_port", "grpc_port"),
                        ("transport", "transport")):
        if key in router:
            data[target] = router[key]
    data["router"] = deep_merge(data.get("router", {}), router)
    data.setdefault("host", "127.0.0.1" if config.ray_address is None else "node")
    tiers = data.setdefault("tiers", {})
    for tier in TIERS:
        spec = tiers.setdefault(tier, {})
        if f"{tier}s" in given:
            spec["replicas"] = given[f"{tier}s"]
        spec["config"] = deep_merge(spec.get("config", {}), worker)
    return load_config(RayDeployment, data, source=config.ray_config or "epd serve --launcher ray")
