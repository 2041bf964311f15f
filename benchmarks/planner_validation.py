"""The cluster simulator against the real cluster on this machine: predicted vs measured TTFT p50 /
p90 and TPOT p50 at three request rates, for ``epd serve`` (1E1P1D) and ``--aggregated``.

In one run: ``epd profile`` measures the stage costs here (at the threads each worker gets), then
for each topology ``epd serve`` is started and ``epd bench`` sweeps the rates (one image a request,
the same seed), and the simulator is given that profile, the topology and the very requests the
bench sent (arrivals, lengths, images, repeats), with the bench's own CPU charged to the host it
shares with the cluster (the profile's ``client`` figures). Printed: each figure predicted / measured and the
error; the issue's bar is 15%.

    python benchmarks/planner_validation.py [--model tiny-qwen2-vl] [--rates 2,4,6] [--num-prompts 48]
        [--sweeps N]              # each topology swept N times: each figure's median
        [--keep DIR]              # also keep the profile and what was measured there
    python benchmarks/planner_validation.py --from DIR   # predict again against a kept run (no cluster)

Only loopback; every process started is stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Server, run_bench  # noqa: F401  (also puts the checkout on sys.path)

_TOPOLOGIES = {"1E1P1D": ((), {}), "aggregated": (("--aggregated",), {"aggregated": True})}
_FIGURES = (("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"))


def profile(model: str, out: Path, threads: int) -> Path:
    subprocess.run([sys.executable, "-m", "epd", "profile", "--model", model, "--out", str(out), "--threads",
                    str(threads), "--image-sizes", "224,448,672", "--encoder-batches", "1,2,4",
                    "--prefill-lengths", "128,512,1024", "--decode-batches", "1,4,16,32",
                    "--contexts", "256,512", "--repeats", "5", "--decode-steps", "40", "--pipeline"],
                   check=True, timeout=1200, stdout=subprocess.DEVNULL)
    return out


def bench_args(args: argparse.Namespace) -> list[str]:
    return ["--num-prompts", str(args.num_prompts), "--request-rate", args.rates, "--image-size", args.image_size,
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed),
            "--repeat-ratio", str(args.repeat_ratio)]


def median_figures(sweeps: list[list[dict]]) -> list[dict]:
    """Each rate's figures, the median over the sweeps (the same requests sent each time)."""
    return [{f"{what}_{q}": statistics.median(run["client"][f"{what}_ms"][q] for run in runs) for what, q in _FIGURES}
            for runs in zip(*sweeps)]


def predict(profile_path: Path, topology_kwargs: dict, args: argparse.Namespace, cores: int) -> list[dict]:
    from epd.bench.workload import WorkloadConfig, parse_image_sizes
    from epd.plan.costs import StageCosts
    from epd.plan.simulate import Topology, requests_from_workload, simulate
    from epd.plan.tiers import SimSettings

    costs = StageCosts.from_profile(profile_path)
    workload = WorkloadConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                              image_sizes=tuple(parse_image_sizes(args.image_size)), repeat_ratio=args.repeat_ratio,
                              seed=args.seed)
    out = []
    for k, rate in enumerate(float(r) for r in args.rates.split(",")):
        # epd bench runs on the same cores as the cluster here: its CPU is charged too
        result = simulate(costs, Topology(cores=cores, **topology_kwargs),
                          requests_from_workload(workload, rate, run_index=k), SimSettings(client_on_host=True))
        out.append({f"{what}_{q}": result.percentile_ms(what, int(q[1:])) for what, q in _FIGURES})
    return out


def compare(profile_path: Path, measured_runs: dict, args: argparse.Namespace, cores: int) -> list[tuple]:
    """-> (topology, rate, predicted, measured) for every measured point."""
    rows = []
    for name, (_, topology_kwargs) in _TOPOLOGIES.items():
        predicted = predict(profile_path, topology_kwargs, args, cores)
        for rate, measured, guess in zip(args.rates.split(","), measured_runs[name], predicted):
            rows.append((name, rate, guess, measured))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--rates", default="2,4,6")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--image-size", default="448x448")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeat-ratio", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="what epd serve gives each worker here")
    ap.add_argument("--sweeps", type=int, default=1,
                    help="send the sweep this many times to each topology and compare with each figure's median "
                         "(a figure measured here varies by 10-20%% between two sweeps of the same requests)")
    ap.add_argument("--keep", help="keep the profile and the measured runs in this directory")
    ap.add_argument("--from", dest="from_dir", help="a directory --keep wrote: predict against it, run nothing "
                    "(the workload options must be the ones it was measured with: they are read from it)")
    args = ap.parse_args()
    if args.from_dir:
        kept = json.loads((Path(args.from_dir) / "measured.json").read_text())
        vars(args).update(kept["args"], from_dir=args.from_dir)
        cores, measured_runs = kept["cores"], kept["runs"]
        profile_path = Path(args.from_dir) / "profile.json"
        rows = compare(profile_path, measured_runs, args, cores)
        profile_json = json.loads(profile_path.read_text())
    else:
        cores = len(os.sched_getaffinity(0))
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = Path(args.keep) if args.keep else Path(tmp)
            out_dir.mkdir(parents=True, exist_ok=True)
            profile_path = profile(args.model, out_dir / "profile.json", args.threads)
            measured_runs = {}
            for name, (flags, _) in _TOPOLOGIES.items():
                sweeps = []
                for k in range(args.sweeps):  # a fresh cluster each: the same images must find cold caches
                    with Server("epd", args.model, "--no-standby", *flags, timeout_s=300) as server:
                        sweeps.append(run_bench(server.url, Path(tmp) / f"{name}-{k}", *bench_args(args)))
                measured_runs[name] = median_figures(sweeps)
            kept_args = {k: v for k, v in vars(args).items() if k not in ("keep", "from_dir")}
            (out_dir / "measured.json").write_text(json.dumps({"args": kept_args, "cores": cores,
                                                               "runs": measured_runs}, indent=1))
            rows = compare(profile_path, measured_runs, args, cores)
            profile_json = json.loads(profile_path.read_text())
    print(f"model={args.model} cores={cores} threads/worker={profile_json['host']['threads']} "
          f"sweeps={args.sweeps} prompts={args.num_prompts} image={args.image_size} input={args.input_len} "
          f"output={args.output_len}")
    print("| topology | rate/s | " + " | ".join(f"{w.upper()} {q} ms predicted / measured (error)"
                                              for w, q in _FIGURES) + " |")
    print("|---|---|" + "---|" * len(_FIGURES))
    worst = 0.0
    for name, rate, predicted, measured in rows:
        cells = []
        for what, q in _FIGURES:
            p, m = predicted[f"{what}_{q}"], measured[f"{what}_{q}"]
            error = (p - m) / m if m else float("nan")
            worst = max(worst, abs(error))
            cells.append(f"{p:.1f} / {m:.1f} ({error:+.0%})")
        print(f"| {name} | {rate} | " + " | ".join(cells) + " |", flush=True)
    print(f"largest error: {worst:.0%} (bar: 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
