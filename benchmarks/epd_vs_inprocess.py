"""TTFT of a 1E1P1D cluster (real processes, gRPC, shm handles, driven by the router's own pipeline)
vs the in-process engine, same model and workload, at low load (one request at a time, distinct
images so no cache hits).

    python benchmarks/epd_vs_inprocess.py [--model small-qwen2-vl] [--num-requests 12] [--image-size 448]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import noise_png  # noqa: E402  (also puts the checkout on sys.path)

from epd.llm import LLM  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.router.sync import SyncRouter  # noqa: E402
from epd.server.local import LocalCluster  # noqa: E402
from epd.types import SamplingParams  # noqa: E402


def messages(image: bytes, i: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": f"Request {i}: what is in the image?"}]}]


def ttft_in_process(llm: LLM, image: bytes, i: int) -> float:
    start = time.perf_counter()
    seq = llm.add_conversation(messages(image, i), SamplingParams(max_tokens=8))
    while seq.num_output_tokens == 0:
        llm.engine.step()
    ttft = time.perf_counter() - start
    llm.engine.run_until_done([seq])
    return ttft


def ttft_cluster(router: SyncRouter, image: bytes, i: int) -> float:
    start = time.perf_counter()
    ttft = None
    for event in router.stream(messages(image, i), SamplingParams(max_tokens=8)):
        if ttft is None and event.token_ids:
            ttft = time.perf_counter() - start
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--no-overlap", action="store_true", help="prefill waits for all rows (no E/P overlap)")
    ap.add_argument("--threads-per-tier", type=int, default=None,
                    help="intra-op threads per tier process (default: the cores split between the tiers)")
    ap.add_argument("--in-process-threads", type=int, default=None,
                    help="intra-op threads of the in-process engine (default: torch's, all cores); give it "
                         "the tiers' count to compare the designs at equal compute per stage")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    num_warmup = 4  # every process pays first-call costs (allocator, thread pools) once
    images = [noise_png(args.image_size, seed) for seed in range(2 * (args.num_requests + num_warmup))]
    warm_local, warm_remote = images[-num_warmup:], images[-2 * num_warmup:-num_warmup]

    if args.in_process_threads:
        torch.set_num_threads(args.in_process_threads)
    in_process_threads = torch.get_num_threads()
    llm = LLM(str(model_dir))
    for img in warm_local:
        ttft_in_process(llm, img, -1)
    local = [ttft_in_process(llm, images[i], i) for i in range(args.num_requests)]
    del llm

    tier_args = {"prefill": ["--no-overlap"]} if args.no_overlap else None
    with LocalCluster(str(model_dir), tier_args=tier_args, threads_per_tier=args.threads_per_tier) as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes) as router:
        for img in warm_remote:
            ttft_cluster(router, img, -2)
        remote = [ttft_cluster(router, images[args.num_requests + i], i) for i in range(args.num_requests)]

    p50_local, p50_remote = statistics.median(local), statistics.median(remote)
    print(f"model={args.model} image={args.image_size}px requests={args.num_requests} (sequential), "
          f"{cluster.threads_per_tier or 'default'} thread(s) per tier, {in_process_threads} in-process")
    print("| system | TTFT p50 ms | TTFT max ms |")
    print("|---|---|---|")
    print(f"| in-process engine | {p50_local * 1e3:.1f} | {max(local) * 1e3:.1f} |")
    print(f"| 1E1P1D cluster (gRPC + shm) | {p50_remote * 1e3:.1f} | {max(remote) * 1e3:.1f} |")
    print(f"cluster/in-process TTFT p50 ratio: {p50_remote / p50_local:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
