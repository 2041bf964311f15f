"""The cluster simulator against the real cluster on this machine: predicted vs measured TTFT p50 /
p90 and TPOT p50 at three request rates, for ``epd serve`` (1E1P1D) and ``--aggregated``.

In one round: ``epd profile`` measures the stage costs here (at the threads each worker gets), then
for each topology ``epd serve`` is started and ``epd bench`` sweeps the rates (one image a request,
the same seed), and the simulator is given that profile, the topology and the very requests the
bench sent (arrivals, lengths, images, repeats), with the bench's own CPU charged to the host it
shares with the cluster (the profile's ``client`` figures). With ``--rounds N`` the round is done N
times (the topologies' order alternating) and each figure is compared as the median of the rounds'
predictions, each from that round's own profile, against the median of the rounds' measurements:
this host's speed drifts within minutes, so a profile is compared with sweeps made beside it.
Printed: each figure predicted / measured, the error, and the measured figure's range over the
rounds (the measurement's own spread); the issue's bar is 15%.

    python benchmarks/planner_validation.py [--model tiny-qwen2-vl] [--rates 2,4,6] [--num-prompts 48]
        [--rounds N]              # profile + sweeps, N times
        [--sweeps N]              # each topology swept N times a round: each figure's median
        [--keep DIR]              # also keep the profiles and what was measured there
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

# name -> (epd serve's flags, the simulator's Topology fields)
_TOPOLOGIES = {"1E1P1D": ((), {}), "aggregated": (("--aggregated",), {"aggregated": True}),
               "2E1P1D": (("--encoders", "2"), {"encoders": 2})}
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


def compare(profile_paths: list[Path], measured_rounds: list[dict], args: argparse.Namespace,
            cores: int) -> list[tuple]:
    """-> ((topology, rate, predicted, measured, measured range) for every measured point: each side
    the median over the rounds (round k predicted from its own profile), the range over the rounds'
    measurements; and each round's own errors, its prediction against its sweeps)."""
    rows, per_round = [], [[] for _ in profile_paths]
    for name in measured_rounds[0]:
        topology_kwargs = _TOPOLOGIES[name][1]
        predicted = [predict(path, topology_kwargs, args, cores) for path in profile_paths]
        for k, (guesses, measured) in enumerate(zip(predicted, measured_rounds)):
            per_round[k] += [(g[key] - m[key]) / m[key] for g, m in zip(guesses, measured[name]) for key in g if m[key]]
        for i, rate in enumerate(args.rates.split(",")):
            guesses = [one[i] for one in predicted]
            measured = [one[name][i] for one in measured_rounds]
            rows.append((name, rate, _median_of(guesses), _median_of(measured),
                         {key: (min(m[key] for m in measured), max(m[key] for m in measured)) for key in measured[0]}))
    return rows, per_round


def _median_of(figures: list[dict]) -> dict:
    return {key: statistics.median(f[key] for f in figures) for key in figures[0]}


def measure_round(k: int, args: argparse.Namespace, out_dir: Path, tmp: Path) -> tuple[Path, dict]:
    """One round: a profile, then each topology swept (the order alternates from round to round:
    neither always runs right after the profile) -> (the profile's path, measured figures)."""
    profile_path = profile(args.model, out_dir / (f"profile-{k}.json" if args.rounds > 1 else "profile.json"),
                           args.threads)
    names = args.topologies if k % 2 == 0 else list(reversed(args.topologies))
    measured = {}
    for name in names:
        flags = _TOPOLOGIES[name][0]
        sweeps = []
        for j in range(args.sweeps):  # a fresh cluster each: the same images must find cold caches
            with Server("epd", args.model, "--no-standby", *flags, timeout_s=300) as server:
                sweeps.append(run_bench(server.url, tmp / f"{name}-{k}-{j}", *bench_args(args)))
        measured[name] = median_figures(sweeps)
    return profile_path, {name: measured[name] for name in args.topologies}


def load_kept(args: argparse.Namespace) -> tuple[int, list[Path], list[dict]]:
    """What ``--keep`` wrote (one round, or several) -> (cores, profile paths, measured rounds)."""
    root = Path(args.from_dir)
    kept = json.loads((root / "measured.json").read_text())
    vars(args).update({"rounds": 1, **kept["args"]}, from_dir=args.from_dir)
    rounds = kept.get("rounds") or [{"profile": "profile.json", "runs": kept["runs"]}]
    return kept["cores"], [root / r["profile"] for r in rounds], [r["runs"] for r in rounds]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--rates", default="2,4,6")
    ap.add_argument("--topologies", default="1E1P1D,aggregated",
                    help=f"comma-separated, of {', '.join(_TOPOLOGIES)}")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--image-size", default="448x448")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeat-ratio", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="what epd serve gives each worker here")
    ap.add_argument("--rounds", type=int, default=1,
                    help="profile and sweep this many times; compare the medians (each round's prediction from "
                         "its own profile)")
    ap.add_argument("--sweeps", type=int, default=1,
                    help="send the sweep this many times to each topology a round and take each figure's median "
                         "(a figure measured here varies by 10-20%% between two sweeps of the same requests)")
    ap.add_argument("--keep", help="keep the profiles and the measured runs in this directory")
    ap.add_argument("--from", dest="from_dir", help="a directory --keep wrote: predict against it, run nothing "
                    "(the workload options must be the ones it was measured with: they are read from it)")
    args = ap.parse_args()
    args.topologies = args.topologies.split(",")
    if unknown := [t for t in args.topologies if t not in _TOPOLOGIES]:
        ap.error(f"--topologies takes {', '.join(_TOPOLOGIES)}, got {', '.join(unknown)}")
    if args.rounds < 1 or args.sweeps < 1:
        ap.error(f"--rounds and --sweeps take 1 or more, got {args.rounds} and {args.sweeps}")
    if args.from_dir:
        cores, profile_paths, measured_rounds = load_kept(args)
        rows, per_round = compare(profile_paths, measured_rounds, args, cores)
    else:
        cores = len(os.sched_getaffinity(0))
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = Path(args.keep) if args.keep else Path(tmp)
            out_dir.mkdir(parents=True, exist_ok=True)
            rounds = [measure_round(k, args, out_dir, Path(tmp)) for k in range(args.rounds)]
            profile_paths, measured_rounds = [path for path, _ in rounds], [runs for _, runs in rounds]
            kept_args = {k: v for k, v in vars(args).items() if k not in ("keep", "from_dir")}
            (out_dir / "measured.json").write_text(json.dumps({
                "args": kept_args, "cores": cores, "runs": _median_rounds(measured_rounds),
                "rounds": [{"profile": path.name, "runs": runs} for path, runs in rounds]}, indent=1))
            rows, per_round = compare(profile_paths, measured_rounds, args, cores)
    threads = json.loads(profile_paths[0].read_text())["host"]["threads"]
    print(f"model={args.model} cores={cores} threads/worker={threads} rounds={args.rounds} "
          f"sweeps={args.sweeps} prompts={args.num_prompts} image={args.image_size} input={args.input_len} "
          f"output={args.output_len}")
    print("| topology | rate/s | " + " | ".join(f"{w.upper()} {q} ms predicted / measured (error) [measured range]"
                                              for w, q in _FIGURES) + " |")
    print("|---|---|" + "---|" * len(_FIGURES))
    errors = []
    for name, rate, predicted, measured, spread in rows:
        cells = []
        for what, q in _FIGURES:
            key = f"{what}_{q}"
            p, m = predicted[key], measured[key]
            error = (p - m) / m if m else float("nan")
            errors.append(abs(error))
            low, high = spread[key]
            cells.append(f"{p:.1f} / {m:.1f} ({error:+.0%})" + (f" [{low:.1f}-{high:.1f}]" if args.rounds > 1 else ""))
        print(f"| {name} | {rate} | " + " | ".join(cells) + " |", flush=True)
    print(f"largest error: {max(errors):.0%}, {_within(errors)} of {len(errors)} within 15% (bar: 15%)")
    if len(per_round) > 1:  # each profile against the sweeps right beside it: how much the host moved
        for k, round_errors in enumerate(per_round):
            print(f"round {k}, its own profile against its own sweeps: {_within(round_errors)} of "
                  f"{len(round_errors)} within 15%, largest {max(map(abs, round_errors)):.0%}")
    return 0


def _within(errors: list[float], bar: float = 0.15) -> int:
    return sum(abs(e) <= bar + 1e-9 for e in errors)


def _median_rounds(measured_rounds: list[dict]) -> dict:
    """Each topology's figures, the median over the rounds (what --from of an older reader compares)."""
    return {name: [_median_of([one[name][i] for one in measured_rounds]) for i in range(len(runs))]
            for name, runs in measured_rounds[0].items()}


if __name__ == "__main__":
    sys.exit(main())
