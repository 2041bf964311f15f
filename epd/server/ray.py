"""EPD on Ray (``epd serve --launcher ray``): each tier worker and the router are Ray actors. Ray
places them (per-tier CPUs, GPUs, custom resources, on any node), restarts them when they die
(``max_restarts``: on their node, or on another when the node is gone) and scales a tier at run
time; the workers still talk gRPC and move tensors as handles, by shared memory between actors on
one node and inline / NCCL between nodes. The deployment is ``epd.config.RayDeployment``.

Each actor binds its own node's address and a port the OS gives it, so an address is known only
once the actor serves and changes when Ray restarts it; the driver's registrar keeps the router's
worker list equal to where the actors serve (``RayEPDCluster``).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import urllib.request

import ray

from epd import loops
from epd.config import TIERS, RayDeployment, RouterConfig, ServeConfig, WorkerConfig, deep_merge, load_config, load_yaml
from epd.server.admin_client import admin_request
from epd.server.parent import descendants, reap_with_me
from epd.server.ray_sizing import ROUTER_CPUS, SizingError, check_fits, demand_breakdown, fit_local

NODE = "node"  # RayDeployment.host: each actor binds its own node's IP
_REGISTER_PERIOD_S = 1.0
_DEAD_WORKER_DRAIN_S = 5.0  # a replaced address: its calls are failing over already
log = logging.getLogger("epd.ray")


def _on_this_node(host: str) -> str:
    """The address an actor binds and advertises: its own node's IP for ``node`` (resolved in the
    actor, on the node Ray placed it: the driver's IP is another machine's)."""
    return ray.util.get_node_ip_address() if host == NODE else host


@ray.remote
class TierActor:
    """One encoder/prefill/decode worker, serving gRPC from inside the actor process. It binds its
    node's address and a port the OS gives it; its host_id is its Ray node, so tensors move by
    shared memory only between workers Ray put on one node."""

    def __init__(self, tier: str, config: WorkerConfig) -> None:
        from epd.server.tier import start_tier
        node_id = ray.get_runtime_context().get_node_id()
        self.running = start_tier(tier, config.model_copy(update={
            "host": _on_this_node(config.host), "port": 0, "host_id": config.host_id or node_id}))
        self.node_id = node_id

    def placement(self) -> tuple[str, str]:
        """(gRPC address, Ray node id): where this life of the actor serves."""
        return self.running.address, self.node_id

    def address(self) -> str:
        return self.running.address

    def metrics_url(self) -> str:
        return self.running.metrics_url

    def pid(self) -> int:
        import os
        return os.getpid()

    def resources(self) -> dict[str, float]:
        """What Ray gave this actor (a tensor-parallel worker: every rank's CPUs and GPUs)."""
        return dict(ray.get_runtime_context().get_assigned_resources())

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
        config = config.model_copy(update={"host": _on_this_node(config.host),
                                           "admin_host": _on_this_node(config.admin_host)})
        self._urls: tuple[str, str, str] | None = None
        self._server = None
        ready = threading.Event()

        def run() -> None:
            loops.run(serve(config, handle_signals=False,
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
    """The actors of one deployment, and the driver-side registrar that keeps the router's worker
    list equal to where the actors serve now: a worker Ray restarted (on its node or another) comes
    back on a new address, and a router Ray restarted comes back with its first list; every
    ``_REGISTER_PERIOD_S`` the registrar asks each actor where it serves and registers what the
    router lacks, and drains what it has that no actor serves any more, through the router's admin
    API (its token made for this cluster). The actors live as long as this driver: Ray ends them
    with it."""

    def __init__(self, deployment: RayDeployment) -> None:
        self.d = deployment
        self.actors: dict[str, list] = {t: [] for t in TIERS}
        self.addresses: dict[str, list[str]] = {t: [] for t in TIERS}  # where each actor serves now
        self.nodes: dict[str, list[str]] = {t: [] for t in TIERS}  # the Ray node id of each
        self.router = None
        self.http_url = self.grpc_address = self.admin_url = None
        self._admin_token = secrets.token_urlsafe(32)
        self._group = None  # placement group that packs prefill and decode workers on one node
        self._group_next = 0
        self._lock = threading.RLock()  # the registrar and scale() change the router's list one at a time
        self._asked: dict[int, ray.ObjectRef] = {}  # actor handle id -> its placement() call in flight
        self._router_asked: ray.ObjectRef | None = None
        self._stopping = threading.Event()
        self._registrar: threading.Thread | None = None

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
        self._registrar = threading.Thread(target=self._register_forever, name="epd-ray-registrar", daemon=True)
        self._registrar.start()
        return self

    def _make_colocation_group(self, timeout_s: float) -> None:
        """STRICT_PACK: every prefill and decode bundle on one node, so KV can move by CUDA IPC/shm.
        Ray moves the whole group to another node when its node dies."""
        from ray.util.placement_group import placement_group
        bundles = []
        for tier in ("prefill", "decode"):
            spec = self.d.tiers[tier]
            bundles += [spec.actor_resources()] * spec.replicas
        self._group, self._group_size = placement_group(bundles, strategy="STRICT_PACK"), len(bundles)
        ray.get(self._group.ready(), timeout=timeout_s)

    def _add_worker(self, tier: str):
        spec = self.d.tiers[tier]
        config = spec.config.model_copy(update={"model": self.d.model, "host": self.d.host, "port": 0,
                                                 "transport": self.d.transport,
                                                 "served_model_name": spec.config.served_model_name
                                                 or self.d.router.served_model_name})
        need = spec.actor_resources()
        options = dict(num_cpus=need["CPU"], num_gpus=need.get("GPU", 0.0), resources=spec.resources or None,
                       max_restarts=spec.max_restarts, max_task_retries=spec.max_restarts)
        if self._group is not None and tier in ("prefill", "decode") and self._group_next < self._group_size:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=self._group_next)
            self._group_next += 1
        actor = TierActor.options(**options).remote(tier, config)
        self.actors[tier].append(actor)
        self.addresses[tier].append("")  # known once it serves
        self.nodes[tier].append("")
        return actor

    def _wait_workers(self, timeout_s: float) -> None:
        slots = [(tier, i) for tier in TIERS for i in range(len(self.actors[tier]))]
        refs = [self.actors[tier][i].placement.remote() for tier, i in slots]
        try:
            placements = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            raise SizingError(f"{len(refs) - len(ready)} of {len(refs)} worker actors were not running after "
                              f"{timeout_s:.0f} s ({demand_breakdown(self.d)}; the cluster has "
                              f"{ray.cluster_resources()}, free {ray.available_resources()})") from None
        for (tier, i), (address, node_id) in zip(slots, placements):
            self.addresses[tier][i], self.nodes[tier][i] = address, node_id

    def _start_router(self, timeout_s: float) -> None:
        config = self.d.router.model_copy(update={
            # the admin API (the registrar, scaling) on a free port of the router's node, with a token made for
            # this cluster
            "admin_port": 0, "admin_host": self.d.host,
            "model": self.d.model, "host": self.d.host, "port": self.d.http_port, "grpc_port": self.d.grpc_port,
            "transport": self.d.transport, **{f"{tier}s": tuple(self.addresses[tier]) for tier in TIERS}})
        self.router = RouterActor.options(num_cpus=ROUTER_CPUS, resources=self.d.router_resources or None,
                                          max_restarts=3, max_task_retries=3).remote(config, self._admin_token)
        self.http_url, self.grpc_address, self.admin_url = ray.get(self.router.urls.remote(), timeout=timeout_s)

    # ---- the registrar -----------------------------------------------------------------------------
    def _register_forever(self) -> None:
        while not self._stopping.wait(_REGISTER_PERIOD_S):
            try:
                self.register()
            except Exception as err:  # noqa: BLE001 - a router restarting, a worker not answering yet: next round
                log.warning("registering workers with the router: %s", err)

    def register(self, wait_s: float = 0.5) -> None:
        """One round: learn where the actors (and the router) serve now, then make the router's
        list match (new addresses registered once they answer health, gone ones drained)."""
        with self._lock:
            self._learn_placements(wait_s)
            have = self._admin("GET")["workers"]
            for tier in TIERS:
                want = {a for a in self.addresses[tier] if a}
                known = {w["address"] for w in have.get(tier, [])}
                for address in sorted(want - known):
                    self._admin("POST", {"tier": tier, "address": address})
                    log.info("registered %s %s with the router", tier, address)
                for address in sorted(known - want):
                    self._admin("DELETE", {"tier": tier, "address": address, "drain_timeout_s": _DEAD_WORKER_DRAIN_S})
                    log.info("removed %s %s from the router (no actor serves there now)", tier, address)

    def _learn_placements(self, wait_s: float) -> None:
        """Ask every actor where it serves (one call in flight per actor: a restarting actor answers
        once it serves again) and the router for its URLs; take the answers that came in ``wait_s``."""
        slots = {id(a): (tier, a) for tier in TIERS for a in self.actors[tier]}
        self._asked = {key: ref for key, ref in self._asked.items() if key in slots}  # removed actors
        for key, (_, actor) in slots.items():
            self._asked.setdefault(key, actor.placement.remote())
        if self._router_asked is None:
            self._router_asked = self.router.urls.remote()
        refs = [*self._asked.values(), self._router_asked]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        done = set(ready)
        for key, ref in list(self._asked.items()):
            if ref not in done:
                continue
            del self._asked[key]
            tier, actor = slots[key]
            i = self.actors[tier].index(actor)
            try:
                self.addresses[tier][i], self.nodes[tier][i] = ray.get(ref)
            except ray.exceptions.RayActorError as err:  # dead (restarting, or out of restarts): asked again next round
                log.warning("%s actor %d is not serving: %s", tier, i, err)
                self.addresses[tier][i] = self.nodes[tier][i] = ""
        if self._router_asked in done:
            ref, self._router_asked = self._router_asked, None
            self.http_url, self.grpc_address, self.admin_url = ray.get(ref)

    # ---- run-time scaling --------------------------------------------------------------------------
    def scale(self, tier: str, replicas: int, timeout_s: float = 300.0) -> None:
        """Add workers (they register with the router) or remove the newest (drained first)."""
        with self._lock:
            while len(self.actors[tier]) < replicas:
                actor = self._add_worker(tier)
                self.addresses[tier][-1], self.nodes[tier][-1] = ray.get(actor.placement.remote(), timeout=timeout_s)
                self._admin("POST", {"tier": tier, "address": self.addresses[tier][-1]})
            while len(self.actors[tier]) > replicas:
                address, actor = self.addresses[tier].pop(), self.actors[tier].pop()
                self.nodes[tier].pop()
                if address:
                    self._admin("DELETE", {"tier": tier, "address": address, "drain_timeout_s": 60})
                ray.kill(actor, no_restart=True)

    def plan(self) -> dict:
        """The router's planner: its wanted workers per tier and its latest decisions."""
        return self._admin("GET", path="/admin/plan")

    def _admin(self, method: str, body: dict | None = None, path: str = "/admin/workers") -> dict:
        return admin_request(self.admin_url, self._admin_token, method, path, body)

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.http_url}/health", timeout=10) as resp:
            return json.loads(resp.read())

    def wait_healthy(self, timeout_s: float = 120.0) -> dict:
        """The router's health once every tier's workers are the actors' current addresses, all
        healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                health = self.health()
                current = all(sorted(w["address"] for w in health["workers"][t]) == sorted(self.addresses[t])
                              for t in TIERS)
                if current and health["status"] == "ok" and all(
                        w["healthy"] for ws in health["workers"].values() for w in ws):
                    return health
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        self._stopping.set()
        if self._registrar is not None:
            self._registrar.join(timeout=30)
        for actor in ([self.router] if self.router else []) + [a for t in TIERS for a in self.actors[t]]:
            try:
                ray.get(actor.stop.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - already dead: kill below anyway
                pass
            ray.kill(actor, no_restart=True)
        # a stopped cluster holds no handle or pending reply (the registrar's): nothing of it is
        # released later, into whatever Ray session this process has by then
        self.actors, self.router, self._asked, self._router_asked = {t: [] for t in TIERS}, None, {}, None
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._group)
            self._group = None


def serve_on_ray(config: ServeConfig, stop: threading.Event) -> None:
    """``epd serve --launcher ray``."""
    deployment = deployment_from(config)
    budget, started = deployment.router.autoscale_budget, sum(spec.replicas for spec in deployment.tiers.values())
    if budget is not None and budget < started:
        raise SizingError(f"--autoscale-budget {budget} is less than the {started} worker actors the deployment "
                          "starts")
    ray.init(address=config.ray_address, include_dashboard=False,
             **({} if config.ray_address else {"_node_ip_address": "127.0.0.1"}))
    for sig in (signal.SIGTERM, signal.SIGINT):  # ray.init installs its own, which kill the driver at once
        signal.signal(sig, lambda *_: stop.set())
    if config.ray_address is None:  # the one-node Ray started here: the tiers share its CPUs
        deployment = fit_local(deployment, ray.cluster_resources().get("CPU", 0.0))
        # and it ends with this process, however it ends: a driver killed hard takes Ray's head
        # processes with it but leaves their agents running
        reaper = reap_with_me(sorted(descendants(os.getpid())))
    cluster = RayEPDCluster(deployment)
    try:
        cluster.start(timeout_s=config.timeout_s)
        if config.ray_address is None:  # and so do its actors (Ray ends them, but nobody frees their segments)
            reaper.add(sorted(descendants(os.getpid()) - {reaper.pid}))
        cluster.wait_healthy(config.timeout_s)
        print(f"epd serve (ray): ready\n  OpenAI API  {cluster.http_url}/v1\n  gRPC API    {cluster.grpc_address}\n"
              f"(Ctrl-C stops everything)", flush=True)
        if deployment.router.autoscale_budget is not None:
            follow_planner(cluster, stop)
        else:
            stop.wait()
    finally:
        print("epd serve (ray): stopping ...", flush=True)
        cluster.stop()
        ray.shutdown()


def follow_planner(cluster, stop: threading.Event, period_s: float = 1.0) -> None:
    """Carry out the router's online planner on Ray until ``stop``: each ``period_s`` its wanted
    workers per tier (``GET /admin/plan``), and each tier scaled to it (``scale``: new actors are
    registered with the router, the newest drained and then killed). Tiers that shrink go first: on
    a full cluster the resources a removed actor frees are what the new one needs."""
    while not stop.wait(period_s):
        try:
            plan = cluster.plan()
        except (OSError, ValueError) as err:  # the router restarting: asked again next round
            log.warning("autoscale: the router's plan is not readable now (%s)", err)
            continue
        reason = plan["decisions"][-1]["reason"] if plan["decisions"] else ""
        changes = [(tier, len(cluster.actors[tier]), plan["desired"][tier]) for tier in TIERS
                   if plan["desired"].get(tier, len(cluster.actors[tier])) != len(cluster.actors[tier])]
        for tier, have, want in sorted(changes, key=lambda change: change[2] - change[1]):
            print(f"epd serve (ray): autoscale: {tier} {have} -> {want}: {reason}", flush=True)
            try:
                cluster.scale(tier, want)
            except Exception as err:  # noqa: BLE001 - one failed scaling must not end the service
                print(f"epd serve (ray): autoscale: scaling {tier} to {want} failed: {err}", file=sys.stderr,
                      flush=True)


def deployment_from(config: ServeConfig) -> RayDeployment:
    """The deployment from ``--ray-config`` with what the command line set on top: model, ports,
    transport, router settings, tier counts, and worker settings for every tier."""
    data = load_yaml(config.ray_config) if config.ray_config else {}
    given = config.model_dump(exclude_unset=True)  # only what the command line (or its files) set wins
    router, worker = given.get("router", {}), given.get("worker", {})
    for key, target in (("model", "model"), ("port", "http_port"), ("grpc_port", "grpc_port"),
                        ("transport", "transport")):
        if key in router:
            data[target] = router[key]
    data["router"] = deep_merge(data.get("router", {}), router)
    data.setdefault("host", "127.0.0.1" if config.ray_address is None else NODE)
    tiers = data.setdefault("tiers", {})
    for tier in TIERS:
        spec = tiers.setdefault(tier, {})
        if f"{tier}s" in given:
            spec["replicas"] = given[f"{tier}s"]
        spec["config"] = deep_merge(spec.get("config", {}), worker)
        if f"{tier}_tp" in given or "tensor_parallel_size" in worker.get("engine", {}):
            # each tier's own size (--prefill-tp / --decode-tp, else -tp; an encoder is never cut)
            spec["config"]["engine"] = {**spec["config"].get("engine", {}),
                                        "tensor_parallel_size": config.tensor_parallel_size(tier)}
    return load_config(RayDeployment, data, source=config.ray_config or "epd serve --launcher ray")
