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
With ``--beside`` each topology's serving-path figures (what ``epd profile --pipeline`` measures on
lone requests beyond the stages) are measured again on a fresh ``epd serve`` of that path right
before its sweep, and the table predicts from those (the profile's own, minutes older: one line).
Printed: each figure predicted / measured, the error, and the measured figure's range over the
rounds (the measurement's own spread); per round, its prediction against its sweeps beside the
other rounds' measured median against them (what the measurement scores against itself); the
issue's bar is 15%.

    python benchmarks/planner_validation.py [--model tiny-qwen2-vl] [--rates 2,4,6] [--num-prompts 48]
        [--rounds N]              # profile + sweeps, N times
        [--sweeps N]              # each topology swept N times a round: each figure's median
        [--beside]                # each topology's path figures measured right before its sweep
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


def compare(profiles: list[dict[str, Path]], measured_rounds: list[dict], args: argparse.Namespace,
            cores: int) -> list[tuple]:
    """-> ((topology, rate, predicted, measured, measured range) for every measured point: each side
    the median over the rounds (round k's prediction of a topology from ``profiles[k][topology]``),
    the range over the rounds' measurements; and each round's own errors, its prediction against its
    sweeps)."""
    rows, per_round = [], [[] for _ in profiles]
    for name in measured_rounds[0]:
        topology_kwargs = _TOPOLOGIES[name][1]
        predicted = [predict(paths[name], topology_kwargs, args, cores) for paths in profiles]
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


def path_beside(profile_path: Path, name: str, model: str, out: Path) -> Path:
    """``profile_path`` with topology ``name``'s serving-path figures measured again now, on a fresh
    ``epd serve`` of that path (``epd.bench.pipeline_costs``), written to ``out``. Why: they are
    what a lone request spends beyond the stages, and this host's speed moves by more than the bar
    in the minutes between a profile and a sweep."""
    from epd.bench.pipeline_costs import measure
    from epd.plan.costs import StageCosts

    data = json.loads(profile_path.read_text())
    path = "aggregated" if _TOPOLOGIES[name][1].get("aggregated") else "epd"
    stages = StageCosts.from_profile({key: value for key, value in data.items() if key != "pipeline"})
    data["pipeline"] = {**data.get("pipeline", {}), **measure(model, stages, paths=(path,))}
    out.write_text(json.dumps(data, indent=1))
    return out


def measure_round(k: int, args: argparse.Namespace, out_dir: Path, tmp: Path) -> dict:
    """One round: a profile, then each topology swept (the order alternates from round to round:
    neither always runs right after the profile; with ``--beside`` its path figures measured just
    before) -> {"profile": path, "profiles": {topology: path} (--beside), "runs": measured figures}."""
    stem = f"profile-{k}" if args.rounds > 1 else "profile"
    profile_path = profile(args.model, out_dir / f"{stem}.json", args.threads)
    names = args.topologies if k % 2 == 0 else list(reversed(args.topologies))
    measured, beside = {}, {}
    for name in names:
        if args.beside:
            beside[name] = path_beside(profile_path, name, args.model, out_dir / f"{stem}-{name}.json")
        flags = _TOPOLOGIES[name][0]
        sweeps = []
        for j in range(args.sweeps):  # a fresh cluster each: the same images must find cold caches
            with Server("epd", args.model, "--no-standby", *flags, timeout_s=300) as server:
                sweeps.append(run_bench(server.url, tmp / f"{name}-{k}-{j}", *bench_args(args)))
        measured[name] = median_figures(sweeps)
    return {"profile": profile_path, **({"profiles": beside} if beside else {}),
            "runs": {name: measured[name] for name in args.topologies}}


def load_kept(args: argparse.Namespace) -> tuple[int, list[dict]]:
    """What ``--keep`` wrote (one round, or several) -> (cores, rounds as ``measure_round`` gives them)."""
    root = Path(args.from_dir)
    kept = json.loads((root / "measured.json").read_text())
    vars(args).update({"rounds": 1, **kept["args"]}, from_dir=args.from_dir)
    rounds = kept.get("rounds") or [{"profile": "profile.json", "runs": kept["runs"]}]
    return kept["cores"], [{"profile": root / r["profile"], "runs": r["runs"],
                            **({"profiles": {name: root / f for name, f in r["profiles"].items()}}
                               if r.get("profiles") else {})} for r in rounds]


def _kept(rounds: list[dict]) -> list[dict]:
    """The rounds as measured.json keeps them (file names beside it)."""
    return [{"profile": r["profile"].name, "runs": r["runs"],
             **({"profiles": {name: path.name for name, path in r["profiles"].items()}} if "profiles" in r else {})}
            for r in rounds]


def _profile_of_each(rounds: list[dict], beside: bool = True) -> list[dict[str, Path]]:
    """Each round's profile for each topology: its path figures measured beside the sweep where they
    were (``beside``), else the round's profile."""
    return [(r.get("profiles") if beside else None) or {name: r["profile"] for name in r["runs"]} for r in rounds]


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
    ap.add_argument("--beside", action="store_true",
                    help="measure each topology's serving-path figures again right before its sweep and predict "
                         "from those (the profile's own, minutes older, summed up in one line)")
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
        cores, rounds = load_kept(args)
        return report(rounds, args, cores)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep) if args.keep else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        rounds = [measure_round(k, args, out_dir, Path(tmp)) for k in range(args.rounds)]
        kept_args = {k: v for k, v in vars(args).items() if k not in ("keep", "from_dir")}
        (out_dir / "measured.json").write_text(json.dumps({
            "args": kept_args, "cores": cores, "runs": _median_rounds([r["runs"] for r in rounds]),
            "rounds": _kept(rounds)}, indent=1))
        return report(rounds, args, cores)


def report(rounds: list[dict], args: argparse.Namespace, cores: int) -> int:
    """The table (each figure predicted / measured), the largest error, and each round's own."""
    measured_rounds = [r["runs"] for r in rounds]
    rows, per_round = compare(_profile_of_each(rounds), measured_rounds, args, cores)
    threads = json.loads(rounds[0]["profile"].read_text())["host"]["threads"]
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
            errors.append(_error(predicted, measured, key))
            low, high = spread[key]
            cells.append(f"{p:.1f} / {m:.1f} ({error:+.0%})" + (f" [{low:.1f}-{high:.1f}]" if args.rounds > 1 else ""))
        print(f"| {name} | {rate} | " + " | ".join(cells) + " |", flush=True)
    print(f"largest error: {max(errors):.0%}, {_within(errors)} of {len(errors)} within 15% (bar: 15%)")
    if any("profiles" in r for r in rounds):  # the same sweeps predicted from the profile's own path figures
        older = [_error(p, m, key) for _, _, p, m, _ in compare(_profile_of_each(rounds, beside=False),
                                                               measured_rounds, args, cores)[0]
                 for key in (f"{what}_{q}" for what, q in _FIGURES)]
        print(f"with the path figures of each round's profile instead (minutes before the sweeps): "
              f"{_within(older)} of {len(older)} within 15%, largest {max(older):.0%}")
    if len(per_round) > 1:  # each profile against the sweeps right beside it: how much the host moved
        itself = _against_itself(measured_rounds)
        for k, (round_errors, own) in enumerate(zip(per_round, itself)):
            print(f"round {k}, its own profile against its own sweeps: {_within(round_errors)} of "
                  f"{len(round_errors)} within 15%, largest {max(map(abs, round_errors)):.0%}; the other rounds' "
                  f"measured median against them: {_within(own)} of {len(own)}, largest {max(own):.0%}")
    return 0


def _against_itself(measured_rounds: list[dict]) -> list[list[float]]:
    """Each round's measured figures predicted by the median of the other rounds' (the same requests
    swept again): what the measurement itself scores here, the floor of any prediction's errors."""
    out = []
    for k, runs in enumerate(measured_rounds):
        others = [r for j, r in enumerate(measured_rounds) if j != k]
        out.append([_error(_median_of([o[name][i] for o in others]), figures, key)
                    for name, points in runs.items() for i, figures in enumerate(points) for key in figures])
    return out


def _error(predicted: dict, measured: dict, key: str) -> float:
    """|predicted - measured| / measured (nan where nothing was measured)."""
    return abs(predicted[key] - measured[key]) / measured[key] if measured[key] else float("nan")


def _within(errors: list[float], bar: float = 0.15) -> int:
    return sum(abs(e) <= bar + 1e-9 for e in errors)


def _median_rounds(measured_rounds: list[dict]) -> dict:
    """Each topology's figures, the median over the rounds (what --from of an older reader compares)."""
    return {name: [_median_of([one[name][i] for one in measured_rounds]) for i in range(len(runs))]
            for name, runs in measured_rounds[0].items()}


if __name__ == "__main__":
    sys.exit(main())
