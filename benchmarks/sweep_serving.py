"""EPD (1E1P1D) vs the aggregated in-process engine vs transformers ``generate``, across request
rates: the same model, workload and SLO, each system started alone and driven by ``epd bench``
(OpenAI API, streaming) in one run. Prints throughput, TTFT p50/p99, TPOT p50 and goodput per rate,
the ratios against the aggregated engine, and writes a PNG.

    python benchmarks/sweep_serving.py [--model small-qwen2-vl] [--rates 1,2,4,8] [--num-prompts 24]
        [--systems epd,aggregated,transformers] [--repeats 1] [--plot docs/img/serving_sweep.png]

A system may name its intra-op threads, ``aggregated:2`` (``--num-threads 2``; default: the thread
policy's choice), so a baseline can be measured at the count that suits it: the right count depends
on the model's size. With ``--repeats N`` every system is started and measured N times, one after
the other, and each run is printed: a point that does not repeat is noise, not a result.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import Server, run_bench

COLUMNS = ("request_throughput", "output_throughput", "ttft_p50", "ttft_p99", "tpot_p50", "goodput", "attainment")


def measure(spec: str, args: argparse.Namespace, tmp: Path) -> dict[float, dict]:
    system, _, threads = spec.partition(":")
    with Server(system, args.model, *(("--num-threads", threads) if threads else ())) as server:
        runs = run_bench(server.url, tmp / spec.replace(":", "-"), "--num-prompts", str(args.num_prompts),
                         "--request-rate", args.rates, "--image-size", args.image_size,
                         "--output-len", str(args.output_len), "--input-len", str(args.input_len),
                         "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
                         "--seed", "7", "--warmup-requests", "2")
    return {run["rate"]: _row(run["client"]) for run in runs}


def _row(client: dict) -> dict:
    return {"request_throughput": client["request_throughput"], "output_throughput": client["output_throughput"],
            "ttft_p50": client["ttft_ms"]["p50"], "ttft_p99": client["ttft_ms"]["p99"],
            "tpot_p50": client["tpot_ms"]["p50"], "goodput": client["goodput"],
            "attainment": client["slo_attainment_pct"], "completed": client["completed"],
            "num_requests": client["num_requests"]}


def print_report(results: dict[str, dict[float, dict]], args: argparse.Namespace) -> None:
    print(f"model={args.model} prompts={args.num_prompts}/rate image={args.image_size} input~{args.input_len} "
          f"output={args.output_len} SLO: TTFT<={args.slo_ttft_ms:.0f} ms, TPOT<={args.slo_tpot_ms:.0f} ms")
    print("| system | rate req/s | done | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
          "goodput req/s | SLO met |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for system, rows in results.items():
        for rate, r in rows.items():
            print(f"| {system} | {rate:g} | {r['completed']}/{r['num_requests']} | {r['request_throughput']:.2f} | "
                  f"{r['output_throughput']:.0f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                  f"{r['tpot_p50']:.1f} | {r['goodput']:.2f} | {r['attainment']:.0f}% |")
    if args.baseline not in results:
        return
    base = results[args.baseline]
    for system, rows in results.items():
        if system == args.baseline:
            continue
        ratios = [f"rate {rate:g}: goodput {_ratio(r['goodput'], base[rate]['goodput'])}, "
                  f"TTFT p50 {_ratio(r['ttft_p50'], base[rate]['ttft_p50'])}"
                  for rate, r in rows.items() if rate in base]
        print(f"{system} / {args.baseline}: " + "; ".join(ratios))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def plot(results: dict[str, dict[float, dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for system, rows in results.items():
        rates = sorted(rows)
        left.plot(rates, [rows[r]["ttft_p50"] for r in rates], marker="o", label=system)
        right.plot(rates, [rows[r]["goodput"] for r in rates], marker="o", label=system)
    left.set(xlabel="request rate (req/s)", ylabel="TTFT p50 (ms)", yscale="log", title="TTFT")
    right.set(xlabel="request rate (req/s)", ylabel="goodput (req/s within SLO)", title="Goodput")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--systems", default="epd,aggregated,transformers")
    ap.add_argument("--rates", default="1,2,4,8")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--image-size", default="448x448")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=1, help="measure every system this many times")
    ap.add_argument("--baseline", default="aggregated", help="the run the ratios are against (with --repeats: "
                                                             "'aggregated#1' names the first run)")
    ap.add_argument("--plot", type=Path, default=None, help="write the TTFT / goodput curves here (PNG)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for repeat in range(1, args.repeats + 1):
            for spec in args.systems.split(","):
                label = spec if args.repeats == 1 else f"{spec}#{repeat}"
                results[label] = measure(spec, args, Path(tmp) / str(repeat))
    print_report(results, args)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
