"""What a Ray deployment asks of the cluster, checked before any actor is placed.

Ray places an actor only where its resources are free and otherwise leaves it pending, silently and
forever; a deployment that cannot fit (three tiers at one CPU each plus the router on a 2-CPU
machine) would hang at start. So the launcher compares the demand with the cluster first: in
total, and for each actor against the largest node (an actor never spans nodes). On a one-node Ray
the launcher started itself, the tiers whose CPUs were not set share what the node has instead
(Ray's CPU counts are scheduling tokens, not a cgroup: half a CPU runs as fast as one).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from epd.config import TIERS, RayDeployment

ROUTER_CPUS = 0.5  # the router actor's request: it is I/O-bound


class SizingError(RuntimeError):
    """The deployment cannot be placed on this cluster; the message says what is asked and what exists."""


def actor_demands(d: RayDeployment) -> list[tuple[str, dict[str, float]]]:
    """(actor name, its resources) of every actor the deployment starts, the router included."""
    out = [("router", {"CPU": ROUTER_CPUS, **d.router_resources})]
    for tier in TIERS:
        spec = d.tiers[tier]
        out += [(f"{tier} {i}", spec.actor_resources()) for i in range(spec.replicas)]
    return out


def fit_local(d: RayDeployment, node_cpus: float) -> RayDeployment:
    """On a one-node Ray of ``node_cpus`` CPUs that this process started: the tiers that did not set
    ``num_cpus`` share what the router leaves, at most one CPU each (an explicit setting is kept and
    checked as given)."""
    free = [t for t in TIERS if d.tiers[t].replicas and "num_cpus" not in d.tiers[t].model_fields_set]
    if not free:
        return d
    fixed = sum(d.tiers[t].actor_resources()["CPU"] * d.tiers[t].replicas for t in TIERS if t not in free)
    ranks = sum(d.tiers[t].replicas * d.tiers[t].ranks for t in free)  # num_cpus is per rank
    share = max(0.0, min(1.0, (node_cpus - ROUTER_CPUS - fixed) / ranks))
    share = int(share * 100) / 100  # Ray takes 1/10000 CPU; round down so the sum never exceeds the node
    if share <= 0:
        return d  # nothing left to share: check_fits names the problem
    tiers = {t: s.model_copy(update={"num_cpus": share}) if t in free else s for t, s in d.tiers.items()}
    return d.model_copy(update={"tiers": tiers})


def check_fits(d: RayDeployment, nodes: Sequence[Mapping[str, float]]) -> None:
    """``nodes``: each live node's total resources. ``SizingError`` when the deployment cannot be
    placed: more of a resource than the cluster has, or an actor larger than every node."""
    demands = actor_demands(d)
    totals: dict[str, float] = {}
    for _, need in demands:
        for key, amount in need.items():
            totals[key] = totals.get(key, 0.0) + amount
    have = {key: sum(node.get(key, 0.0) for node in nodes) for key in totals}
    short = {key: (totals[key], have[key]) for key in totals if totals[key] > have[key] + 1e-9}
    if short:
        asked = ", ".join(f"{amount:g} {key}" for key, (amount, _) in short.items())
        exists = ", ".join(f"{available:g} {key}" for key, (_, available) in short.items())
        raise SizingError(f"the deployment asks for {asked} ({demand_breakdown(d)}), the Ray cluster has {exists} on "
                          f"{len(nodes)} node(s): lower the tiers' num_cpus / num_gpus / resources or replicas, "
                          f"or add nodes")
    for name, need in demands:
        if not any(all(node.get(key, 0.0) + 1e-9 >= amount for key, amount in need.items()) for node in nodes):
            largest = max(nodes, key=lambda node: node.get("CPU", 0.0), default={})
            raise SizingError(f"actor '{name}' asks for {_format(need)} and no single node has that (the largest "
                              f"has {_format({k: largest.get(k, 0.0) for k in need})}); an actor runs on one node")


def demand_breakdown(d: RayDeployment) -> str:
    parts = [f"router {ROUTER_CPUS:g} CPU"]
    for tier in TIERS:
        spec = d.tiers[tier]
        if spec.replicas:
            need = spec.actor_resources()
            parts.append(f"{spec.replicas} {tier} x {need['CPU']:g} CPU" +
                         (f" + {need['GPU']:g} GPU" if spec.num_gpus else "") +
                         (f" ({spec.ranks} tensor-parallel ranks each)" if spec.ranks > 1 else ""))
    return ", ".join(parts)


def _format(need: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {key}" for key, amount in need.items())
