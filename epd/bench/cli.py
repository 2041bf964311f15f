"""``epd bench``: a load generator for an EPD router (or any OpenAI-compatible server).

Sends multimodal chats (synthetic images and word prompts, or a JSONL dataset's) at Poisson / gamma
arrivals, streams every answer to measure TTFT, TPOT, inter-token and end-to-end latency, and reports throughput,
goodput under an SLO, and the router's own figures (encoder-cache hit rate, queues) from /metrics.
Prompts and images are a function of --seed: rerunning with the same seed against a warm server
hits its caches (change the seed, or use --repeat-ratio to measure cache hits on purpose)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from epd.bench import report
from epd.bench.client import GrpcDriver, OpenAIDriver, RequestRecord, normalize_base_url
from epd.bench.datasets import LOADERS, take, with_arrivals
from epd.bench.metrics import MetricsSampler, server_summary, summarize
from epd.bench.report import report_choice
from epd.bench.runner import rate_label, run_once
from epd.bench.workload import (
    RequestSpec,
    WorkloadConfig,
    arrival_times,
    build_workload,
    parse_bucket_config,
    parse_image_sizes,
    parse_rates,
    render_images,
)

_WARMUP_RUN_INDEX = 1_000_003  # its own seed space: warm-up images never repeat in a measured run


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, but not a None (the help then says what happens)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epd bench", description=__doc__.split("\n\n")[0],
                                formatter_class=_DefaultsShown)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's HTTP URL (a trailing /v1 is accepted; the default is where epd serve --port "
                        "8000 listens); its /metrics is scraped")
    t.add_argument("--backend", choices=("openai", "grpc"), default="openai",
                   help="openai: streaming /v1/chat/completions; grpc: the public gRPC API via epd.client")
    t.add_argument("--grpc-address", default="127.0.0.1:50051", help="the router's gRPC address (--backend grpc)")
    t.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    t.add_argument("--api-key", help="sent as a Bearer token (openai backend; default: $OPENAI_API_KEY, as the "
                                     "openai client reads it)")
    t.add_argument("--extra-body", default=None,
                   help="a JSON object merged into every request body (openai backend), e.g. "
                        "'{\"mm_processor_kwargs\": {\"max_pixels\": 50176}}'")
    t.add_argument("--metrics-url", action="append", default=[],
                   help="another Prometheus endpoint to scrape as well, e.g. a worker's (repeatable)")
    t.add_argument("--no-metrics", action="store_true", help="do not scrape any /metrics")
    t.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request timeout")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", choices=("random-mm", *LOADERS), default="random-mm",
                   help="random-mm: synthetic prompts and images (vLLM's name; the options below); jsonl: "
                        "requests from --dataset-path (epd/bench/datasets.py: one {prompt, images, output_len} "
                        "object per line); sharegpt / vision-arena: those datasets' rows from a local file")
    w.add_argument("--dataset-path", help="the local file of --dataset-name jsonl, sharegpt or vision-arena")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run: 100, or with a dataset all of its rows")
    w.add_argument("--request-rate", default="inf",
                   help="requests/s, 'inf' (all at once), or a comma list for one run per rate, e.g. 1,2,4,8")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular")
    w.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    w.add_argument("--images-per-request", "--random-mm-base-items-per-request", type=int, default=1,
                   help="images in each synthetic request (random-mm)")
    w.add_argument("--random-mm-num-mm-items-range-ratio", dest="items_range_ratio", type=float, default=0.0,
                   help="images per request drawn uniformly from base * [1 - r, 1 + r]")
    w.add_argument("--image-size", default="448x448",
                   help="WxH[:weight][,WxH[:weight]...]: image sizes and their relative probabilities")
    w.add_argument("--random-mm-bucket-config", default=None,
                   help="vLLM's form of --image-size: \"{(height, width, 1): probability, ...}\" (images only)")
    w.add_argument("--image-kind", choices=("gradient", "noise"), default="gradient",
                   help="synthetic image content (noise makes large PNGs)")
    w.add_argument("--repeat-ratio", type=float, default=0.0,
                   help="probability that an image re-sends an earlier one (exercises the encoder cache)")
    w.add_argument("--input-len", "--random-input-len", type=int, default=128,
                   help="text prompt length in (about) tokens")
    w.add_argument("--text-first", action="store_true",
                   help="put the text before the images (a long context ahead of an image: what EPD's "
                        "encode/prefill overlap speeds up); openai backend")
    w.add_argument("--output-len", "--random-output-len", type=int, default=64,
                   help="output tokens per request (EOS ignored)")
    w.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="input and output lengths drawn uniformly from len * [1 - r, 1 + r] (vLLM's)")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, images and arrivals")
    w.add_argument("--warmup-requests", type=int, default=1,
                   help="requests sent (and checked) before measuring, not counted")

    r = p.add_argument_group("run and report")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="which latencies the table gives percentiles of: a comma list of ttft, tpot, itl, e2el "
                        "(vLLM's names)")
    r.add_argument("--metric-percentiles", default="50,90,99",
                   help="which percentiles, a comma list of numbers in (0, 100] (summary.json always has 50 and "
                        "99 as well)")
    r.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput / attainment")
    r.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput / attainment")
    r.add_argument("--max-duration-s", type=float, default=None,
                   help="stop issuing requests after this many seconds (per run)")
    r.add_argument("--grace-s", type=float, default=10.0,
                   help="with --max-duration-s: cancel requests still running this long after it")
    r.add_argument("--scrape-interval-s", type=float, default=1.0, help="how often /metrics is sampled during a run")
    r.add_argument("--settle-s", type=float, default=1.5,
                   help="wait before the before/after /metrics scrapes: the router's cluster view (encoder "
                        "items, worker queues) is refreshed by its health checks, about once a second")
    r.add_argument("--out", help="directory for records.jsonl, summary.json and PNG plots")
    r.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[WorkloadConfig, list[float]]:
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY") or None
    if args.extra_body is not None:
        try:
            args.extra_body = json.loads(args.extra_body)
        except ValueError as err:
            parser.error(f"--extra-body: not JSON ({err})")
        if not isinstance(args.extra_body, dict):
            parser.error(f"--extra-body: expected a JSON object, got {type(args.extra_body).__name__}")
        if args.backend != "openai":
            parser.error("--extra-body needs --backend openai (the gRPC API has no free-form body)")
    if args.text_first and args.backend != "openai":
        parser.error("--text-first needs --backend openai (the SDK puts images first)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.max_duration_s is not None and args.max_duration_s <= 0:
        parser.error("--max-duration-s must be > 0")
    if args.settle_s < 0:
        parser.error("--settle-s must be >= 0")
    if args.grace_s < 0 or args.scrape_interval_s <= 0 or args.request_timeout_s <= 0:
        parser.error("--grace-s must be >= 0, --scrape-interval-s and --request-timeout-s > 0")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.warmup_requests < 0:
        parser.error("--warmup-requests must be >= 0")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        parser.error("--burstiness must be a positive number")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if (args.dataset_name != "random-mm") != (args.dataset_path is not None):
        parser.error("--dataset-path goes with --dataset-name jsonl, sharegpt or vision-arena, which need it")
    try:
        rates = parse_rates(args.request_rate)
        sizes = parse_bucket_config(args.random_mm_bucket_config) if args.random_mm_bucket_config else \
            parse_image_sizes(args.image_size)
        cfg = WorkloadConfig(num_prompts=args.num_prompts or 100, input_len=args.input_len,
                             output_len=args.output_len, images_per_request=args.images_per_request,
                             image_sizes=tuple(sizes), image_kind=args.image_kind, repeat_ratio=args.repeat_ratio,
                             seed=args.seed, range_ratio=args.range_ratio, items_range_ratio=args.items_range_ratio)
        args.report = report_choice(args.percentile_metrics, args.metric_percentiles)
        args.dataset = LOADERS[args.dataset_name](args.dataset_path, default_output_len=args.output_len) \
            if args.dataset_path else None
    except ValueError as err:
        parser.error(str(err))
    return cfg, rates


def _requests(args: argparse.Namespace, cfg: WorkloadConfig, rate: float, run_index: int) -> list[RequestSpec]:
    """One run's requests: the synthetic workload (fresh prompts and images per run), or the
    dataset's (the same each run: a later run meets caches the earlier ones warmed)."""
    if args.dataset is None:
        return build_workload(cfg, rate, args.burstiness, run_index=run_index)
    requests = take(args.dataset, args.num_prompts)
    rng = np.random.default_rng([cfg.seed, run_index, 1])
    return with_arrivals(requests, arrival_times(len(requests), rate, args.burstiness, rng))


def _make_driver(args: argparse.Namespace):
    if args.backend == "grpc":
        return GrpcDriver(args.grpc_address, timeout_s=args.request_timeout_s)
    return OpenAIDriver(args.base_url, model=args.model, api_key=args.api_key, timeout_s=args.request_timeout_s,
                        text_first=args.text_first, extra_body=args.extra_body)


def _metrics_urls(args: argparse.Namespace) -> list[str]:
    if args.no_metrics:
        return []
    urls = [normalize_base_url(args.base_url) + "/metrics"] if args.base_url else []
    return urls + list(args.metrics_url)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _warmup(driver, cfg: WorkloadConfig, n: int) -> None:
    requests = build_workload(cfg, math.inf, 1.0, run_index=_WARMUP_RUN_INDEX)[:n]
    for spec in requests:
        spec.output_len = min(spec.output_len, 8)
    await asyncio.to_thread(render_images, requests)
    records = [RequestRecord(index=s.index, rate=math.inf, scheduled_s=0.0) for s in requests]
    await asyncio.gather(*(driver.send(s, r, 0.0) for s, r in zip(requests, records)))
    bad = [r for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0].error}")


async def run_bench(args: argparse.Namespace, cfg: WorkloadConfig, rates: list[float]) -> list[dict]:
    """Every run of the sweep; prints the tables, writes --out; returns the run summaries."""
    driver = _make_driver(args)
    runs: list[dict] = []
    records_by_run: list[list[RequestRecord]] = []
    try:
        target = args.grpc_address if args.backend == "grpc" else driver.base_url
        try:
            if args.model is None or args.backend == "grpc":
                model = await driver.resolve_model()
            else:
                model = args.model
        except Exception as exc:
            raise RuntimeError(f"cannot reach {target}: {type(exc).__name__}: {exc}") from None
        _log(f"epd bench: {args.backend} backend, target {target}, model {model}")
        if args.warmup_requests:
            await _warmup(driver, cfg, args.warmup_requests)
        for k, rate in enumerate(rates):
            requests = _requests(args, cfg, rate, k)
            nbytes = await asyncio.to_thread(render_images, requests)
            source = f"from {args.dataset_path}" if args.dataset is not None else \
                f"{cfg.images_per_request} image(s) each"
            _log(f"run {k + 1}/{len(rates)}: {len(requests)} requests at rate {rate_label(rate)} req/s "
                 f"(burstiness {args.burstiness:g}), {source}, {nbytes / 2**20:.1f} MiB of distinct images")
            urls = _metrics_urls(args)
            sampler = MetricsSampler(urls, interval_s=args.scrape_interval_s) if urls else None
            result = await run_once(driver, requests, rate=rate, max_concurrency=args.max_concurrency,
                                    max_duration_s=args.max_duration_s, grace_s=args.grace_s, sampler=sampler,
                                    settle_s=args.settle_s,
                                    progress=not args.no_progress, label=f"rate {rate_label(rate)} ")
            client = summarize(result.records, result.duration_s, slo_ttft_ms=args.slo_ttft_ms,
                               slo_tpot_ms=args.slo_tpot_ms, num_not_sent=result.num_not_sent,
                               percentiles=args.report.percentiles)
            server = None
            if sampler is not None:
                server = server_summary(result.metrics_before, result.metrics_after, result.metrics_samples,
                                        images_sent=client["images_sent"])
                if sampler.errors:
                    server["scrape_errors"] = sampler.errors[:5]
            run = {"rate": rate, "backend": args.backend, "model": model, "client": client, "server": server}
            print(report.format_table(run, args.report), flush=True)
            runs.append(run)
            records_by_run.append(result.records)
    finally:
        await driver.aclose()
    if len(runs) > 1:
        print(report.format_sweep(runs), flush=True)
    if args.out:
        out = Path(args.out)
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "dataset", "report")}
        files = report.write_json(out, config, runs, [r for recs in records_by_run for r in recs])
        if not args.no_plots:
            plots = report.write_plots(out, runs, records_by_run)
            if not plots:
                _log("epd bench: matplotlib does not import, so no plots; it comes with the bench extra: "
                     "pip install 'epd[bench]' (scripts/setup.sh installs it)")
            files += plots
        _log("epd bench: wrote " + ", ".join(str(f) for f in files))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg, rates = _check(args, parser)
    try:
        runs = asyncio.run(run_bench(args, cfg, rates))
    except KeyboardInterrupt:
        _log("epd bench: interrupted")
        return 130
    except RuntimeError as err:
        _log(f"epd bench: error: {err}")
        return 1
    return 0 if any(run["client"]["completed"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
