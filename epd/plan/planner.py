"""``epd plan``: rank the ways to split a budget of devices between the tiers by simulated goodput per
device, for one profile (``epd profile``), one workload and one SLO.

    epd plan --profile profile.json --devices 8 --slo ttft=300,tpot=40 \\
        [--image-size 448x448] [--images-per-request 1] [--input-len 128] [--output-len 64] \\
        [--repeat-ratio 0] [--tp 1,2] [--cores N] [--plot goodput.png] [--json] [--jobs N]

Splits: the aggregated engine (one per device, the load spread evenly), and every E:P:D that fits
the budget (an encoder per device, prefill and decode workers of each ``--tp`` size), encoders only
where the workload has images. For each, the highest request rate whose requests meet the SLO (at
least ``--attainment`` of them) is found by bisection on the simulator; its goodput over the devices
it uses ranks it. ``--cores N``: one CPU host of N cores that every process shares (as ``epd serve``
runs here) instead of a device per worker.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from epd.plan.costs import StageCosts
from epd.plan.simulate import SimResult, Topology, requests_from_workload, simulate
from epd.plan.tiers import SimSettings

_SEARCH_STEPS = 8
_MAX_RATE = 10_000.0


@dataclass
class Ranked:
    topology: Topology
    devices: int
    rate: float  # highest requests/s meeting the SLO
    goodput: float  # requests/s meeting it, at that rate
    at_rate: dict  # the simulator's summary there

    @property
    def per_device(self) -> float:
        return self.goodput / self.devices


def splits(devices: int, tp_sizes: list[int], with_images: bool, cores: float | None) -> list[Topology]:
    """Every topology to try within ``devices`` (with ``cores``: workers on one host, up to 2 per core)."""
    budget = devices if cores is None else max(2, int(2 * cores))
    out = [Topology(aggregated=True, cores=cores)]
    for tp_p, tp_d in itertools.product(tp_sizes, repeat=2):
        for e in range(1 if with_images else 0, budget + 1):
            for p in range(1, budget + 1):
                for d in range(1, budget + 1):
                    if e + p * tp_p + d * tp_d <= budget:
                        out.append(Topology(encoders=e, prefills=p, decodes=d, prefill_tp=tp_p,
                                            decode_tp=tp_d, cores=cores))
    return out


def _run(costs: StageCosts, topology: Topology, workload, rate: float, replicas: int) -> SimResult:
    return simulate(costs, topology, requests_from_workload(workload, rate / replicas))


def capacity(costs: StageCosts, topology: Topology, workload, settings: SimSettings = SimSettings()) -> float:
    """Requests/s the busiest tier could serve flat out, from the stage costs alone: where the
    search for the SLO's rate starts (the simulator then adds queues, batching and contention)."""
    from epd.plan.simulate import IMAGE_MARK_TOKENS, TEMPLATE_TOKENS, image_rows

    sizes = workload.image_sizes
    pixels = sum(s.width * s.height * s.weight for s in sizes) / sum(s.weight for s in sizes)
    rows = sum(image_rows(s.width, s.height) * s.weight for s in sizes) / sum(s.weight for s in sizes)
    images = workload.images_per_request * (1 - workload.repeat_ratio)
    tokens = workload.input_len + TEMPLATE_TOKENS + workload.images_per_request * (rows + IMAGE_MARK_TOKENS)
    batch, context = settings.max_num_seqs, tokens + workload.output_len / 2
    encode_ms = images * costs.encoder_ms(pixels, 8)
    prefill_ms = costs.prefill_ms(int(tokens))
    decode_ms = workload.output_len * costs.decode_ms(batch, context, settings.sampled) / batch
    speed = lambda tp: 1.0 if tp == 1 else tp * settings.tp_efficiency  # noqa: E731
    if topology.aggregated:
        return 1000.0 / max(encode_ms + prefill_ms + decode_ms, 1e-3)
    limits = [topology.prefills * speed(topology.prefill_tp) * 1000.0 / max(prefill_ms, 1e-3),
              topology.decodes * speed(topology.decode_tp) * 1000.0 / max(decode_ms, 1e-3)]
    if encode_ms > 0:
        limits.append(topology.encoders * 1000.0 / encode_ms)
    workers = topology.encoders + topology.prefills + topology.decodes
    # on a host of fewer cores than workers, every worker runs at most at its share of them
    return min(limits) * (min(1.0, topology.cores / workers) if topology.cores else 1.0)


def best_rate(costs: StageCosts, topology: Topology, workload, slo: dict, attainment: float,
              replicas: int = 1) -> tuple[float, SimResult | None]:
    """The highest rate (requests/s over all ``replicas``) meeting the SLO, and the run there:
    bisection between nothing and a little past the busiest tier's capacity."""
    def meets(rate: float) -> SimResult | None:
        result = _run(costs, topology, workload, rate, replicas)
        return result if result.attainment(slo.get("ttft"), slo.get("tpot")) >= attainment else None

    low, low_result, high = 0.0, None, 1.5 * replicas * capacity(costs, topology, workload)
    while (found := meets(high)) is not None and high < _MAX_RATE:  # the estimate was short: look further
        low, low_result, high = high, found, high * 2
    for _ in range(_SEARCH_STEPS):
        mid = (low + high) / 2
        if (found := meets(mid)) is not None:
            low, low_result = mid, found
        else:
            high = mid
    return low, low_result


def _rank_one(args: tuple) -> Ranked | None:
    """One split's search (a pool's task: everything it needs comes in ``args``)."""
    costs, topology, workload, slo, attainment, devices, cores = args
    replicas = devices if topology.aggregated and cores is None else 1
    used = replicas if topology.aggregated else topology.devices
    rate, result = best_rate(costs, topology, workload, slo, attainment, replicas)
    if result is None:
        return None
    goodput = rate * result.attainment(slo.get("ttft"), slo.get("tpot"))  # good requests/s at that load
    return Ranked(topology, used, rate, goodput, result.summary())


def rank(costs: StageCosts, workload, slo: dict, devices: int, tp_sizes: list[int], cores: float | None,
         attainment: float = 0.9, workers: int = 1) -> list[Ranked]:
    """Every split's best, ranked; ``workers`` > 1 searches them in that many processes."""
    tasks = [(costs, topology, workload, slo, attainment, devices, cores)
             for topology in splits(devices, tp_sizes, workload.images_per_request > 0, cores)]
    if workers > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawned, not forked: a caller may hold threads (torch's, gRPC's) a fork would copy mid-flight;
        # the planner imports no torch, so a worker starts in a fraction of a second
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
            found = list(pool.map(_rank_one, tasks, chunksize=max(1, len(tasks) // (4 * workers))))
    else:
        found = [_rank_one(task) for task in tasks]
    return sorted((r for r in found if r is not None), key=lambda r: (-r.per_device, r.devices))


def parse_slo(text: str) -> dict:
    slo = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in ("ttft", "tpot") or not value:
            raise ValueError(f"--slo: expected ttft=MS,tpot=MS, got {part!r}")
        slo[name] = float(value)
    return slo


def _plot(ranked: list[Ranked], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ranked[:20]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(shown)), 4))
    ax.bar([r.topology.label() for r in shown], [r.per_device for r in shown])
    ax.set_ylabel("goodput per device (requests/s)")
    ax.set_title("simulated goodput per device by split")
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    from epd.bench.workload import WorkloadConfig, parse_image_sizes

    p = argparse.ArgumentParser(prog="epd plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="an epd profile JSON")
    p.add_argument("--devices", type=int, default=8, help="devices (GPUs) to split; with --cores, ignored")
    p.add_argument("--cores", type=float, default=None, help="one CPU host of this many cores shared by all")
    p.add_argument("--slo", default="ttft=1000,tpot=100", help="ttft=MS,tpot=MS")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    p.add_argument("--tp", default="1", help="tensor-parallel sizes to try for prefill and decode, e.g. 1,2")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--image-size", default="448x448")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes searching the splits (default: the cores this process may use)")
    p.add_argument("--plot", help="draw goodput per device by split into this PNG")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    args = p.parse_args(argv)
    try:
        costs = StageCosts.from_profile(Path(args.profile))
        slo = parse_slo(args.slo)
        tp_sizes = sorted({int(t) for t in args.tp.split(",")})
        if args.devices < 1 or any(t < 1 for t in tp_sizes) or not 0 < args.attainment <= 1 or \
                (args.jobs is not None and args.jobs < 1):
            raise ValueError("--devices, --tp and --jobs must be >= 1, --attainment in (0, 1]")
        workload = WorkloadConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                                  images_per_request=args.images_per_request,
                                  image_sizes=tuple(parse_image_sizes(args.image_size)),
                                  repeat_ratio=args.repeat_ratio, seed=args.seed)
    except (OSError, ValueError) as err:
        print(f"epd plan: error: {err}", file=sys.stderr)
        return 2
    jobs = args.jobs or len(os.sched_getaffinity(0))
    ranked = rank(costs, workload, slo, args.devices, tp_sizes, args.cores, args.attainment, workers=jobs)
    if args.json:
        print(json.dumps([{**asdict(r), "per_device": r.per_device, "label": r.topology.label()} for r in ranked],
                         indent=2))
    else:
        _print(ranked[:args.top], costs, args)
    if args.plot and ranked:
        _plot(ranked, args.plot)
    if not ranked:
        print("epd plan: no split meets the SLO at any rate (loosen --slo or add devices)", file=sys.stderr)
        return 1
    return 0


def _print(ranked: list[Ranked], costs: StageCosts, args) -> None:
    where = f"one host of {args.cores:g} cores" if args.cores else f"{args.devices} devices"
    print(f"epd plan: {costs.model} on {costs.device} ({where}), SLO {args.slo} for {args.attainment:.0%} of requests")
    print("| rank | split | devices | max rate/s | goodput/s | per device | TTFT p90 ms | TPOT p50 ms | utilization |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(ranked, 1):
        s = r.at_rate
        busy = ", ".join(f"{k} {v:.0%}" for k, v in s["utilization"].items())
        tpot = "-" if s["tpot_p50_ms"] is None else f"{s['tpot_p50_ms']:.1f}"
        print(f"| {i} | {r.topology.label()} | {r.devices} | {r.rate:.2f} | {r.goodput:.2f} | {r.per_device:.2f} | "
              f"{s['ttft_p90_ms']:.0f} | {tpot} | {busy} |")
    if ranked:
        best = ranked[0]
        print(f"best: {best.topology.label()} on {best.devices} device(s): {best.per_device:.2f} good requests/s per "
              f"device (predicted TTFT p90 {best.at_rate['ttft_p90_ms']:.0f} ms)")


if __name__ == "__main__":
    sys.exit(main())
