"""Peak resident memory of each tier process vs the in-process engine, after the same workload.

The EPD paper's point: the decode tier holds no vision weights or activations, and the encoder no
KV cache. Peak RSS (VmHWM from /proc) per process, same model, 16 one-image requests.

    python benchmarks/memory_per_tier.py [--model small-qwen2-vl] [--num-requests 16]
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from common import noise_png  # noqa: E402  (also puts the checkout on sys.path)

from epd.models.locate import resolve_model  # noqa: E402
from epd.router.sync import SyncRouter  # noqa: E402
from epd.server.local import LocalCluster  # noqa: E402
from epd.types import SamplingParams  # noqa: E402


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def messages(image: bytes, i: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": f"#{i}"}]}]


IN_PROCESS = """
import sys, resource
sys.path.insert(0, {root!r})
from common import noise_png
from epd.llm import LLM
from epd.types import SamplingParams
llm = LLM({model!r})
convs = [[{{"role": "user", "content": [{{"type": "image", "image": noise_png(448, i)}}, {{"type": "text", "text": f"#{{i}}"}}]}}]
         for i in range({n})]
llm.chat(convs, SamplingParams(max_tokens=32, ignore_eos=True))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--num-requests", type=int, default=16)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    bench_dir = str(__import__("pathlib").Path(__file__).resolve().parent)
    code = IN_PROCESS.format(root=bench_dir, model=str(model_dir), n=args.num_requests)
    in_process = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1])
    with LocalCluster(str(model_dir)) as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes) as router:
        for i in range(args.num_requests):
            router.chat(messages(noise_png(448, i), i), SamplingParams(max_tokens=32, ignore_eos=True))
        peaks = {p.tier: peak_rss_mib(p.proc.pid) for p in cluster.processes}
    print(f"model={args.model} requests={args.num_requests} (448x448, 32 output tokens)")
    print("| process | peak RSS MiB | vs in-process |")
    print("|---|---|---|")
    print(f"| in-process engine (vision + LLM) | {in_process:.0f} | 1.00 |")
    for tier, mib in peaks.items():
        print(f"| {tier} tier | {mib:.0f} | {mib / in_process:.2f} |")


if __name__ == "__main__":
    main()
