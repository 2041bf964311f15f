"""Where the encoder dominates TTFT: images per request 1 -> 8 (448x448) and image size 224 -> 896
(one image), EPD (1E1P1D) vs the aggregated engine, at low load (one request at a time).

For each point it also times the vision tower alone in this process (preprocess + forward of the
same images, before any server starts) and reports its share of the aggregated engine's TTFT.

    python benchmarks/sweep_images.py [--model small-qwen2-vl] [--counts 1,2,4,8] [--sizes 224,448,672,896]
        [--num-prompts 8] [--plot docs/img/images_sweep.png]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import Server, run_bench

from epd.bench.workload import ImageSpec, render_image  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.models.qwen2_vl.vision import QwenVisionEncoder  # noqa: E402

SYSTEMS = ("epd", "aggregated")


def points(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(label, images per request, side px)."""
    counts = [(f"{n} x 448px", n, 448) for n in map(int, args.counts.split(","))]
    sizes = [(f"1 x {s}px", 1, s) for s in map(int, args.sizes.split(",")) if s != 448]
    return counts + sizes


def with_max_pixels(model: str, max_pixels: int, out: Path) -> str:
    """The checkpoint with its image processor's pixel cap raised (the presets cap images at ~633 px
    a side, which would flatten the size sweep): symlinks, only preprocessor_config.json rewritten."""
    src = resolve_model(model)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "preprocessor_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((src / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = max_pixels
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def encoder_ms(encoder: QwenVisionEncoder, count: int, side: int, repeats: int = 5) -> float:
    """Median preprocess + forward of ``count`` images of ``side`` px, alone in this process."""
    times = []
    for r in range(repeats + 1):
        images = [render_image(ImageSpec(side, side, seed=1000 * r + i)) for i in range(count)]
        start = time.perf_counter()
        encoder.encode_images(images)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3  # the first pays one-time costs


def ttft_p50(system_url: str, out: Path, count: int, side: int, args: argparse.Namespace) -> float:
    runs = run_bench(system_url, out, "--num-prompts", str(args.num_prompts), "--request-rate", "inf",
                     "--max-concurrency", "1", "--images-per-request", str(count),
                     "--image-size", f"{side}x{side}", "--input-len", "32", "--output-len", "8",
                     "--seed", str(count * 1000 + side), "--warmup-requests", "2")
    return runs[0]["client"]["ttft_ms"]["p50"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--sizes", default="224,448,672,896")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--max-pixels", type=int, default=896 * 896, help="image processor cap (size.longest_edge)")
    args = ap.parse_args()
    grid = points(args)
    ttft: dict[str, dict[str, float]] = {s: {} for s in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        model = with_max_pixels(args.model, args.max_pixels, Path(tmp) / "model")
        encoder = QwenVisionEncoder(model)
        alone = {label: encoder_ms(encoder, n, side) for label, n, side in grid}
        del encoder
        for system in SYSTEMS:
            with Server(system, model) as server:
                for label, n, side in grid:
                    ttft[system][label] = ttft_p50(server.url, Path(tmp) / f"{system}-{n}-{side}", n, side, args)
    print(f"model={args.model}, one request at a time, text ~32 tokens, 8 output tokens, {args.num_prompts} "
          f"requests per point")
    print("| images | encoder alone ms | aggregated TTFT p50 ms | encoder share | EPD TTFT p50 ms | EPD / aggregated |")
    print("|---|---|---|---|---|---|")
    for label, _, _ in grid:
        agg, epd = ttft["aggregated"][label], ttft["epd"][label]
        print(f"| {label} | {alone[label]:.0f} | {agg:.0f} | {alone[label] / agg:.0%} | {epd:.0f} | {epd / agg:.2f}x |")
    if args.plot:
        plot(grid, alone, ttft, args.plot)
        print(f"plot: {args.plot}")


def plot(grid, alone, ttft, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _, _ in grid]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    ax.bar([x - width for x in xs], [alone[lb] for lb in labels], width, label="vision tower alone")
    ax.bar(list(xs), [ttft["aggregated"][lb] for lb in labels], width, label="aggregated TTFT p50")
    ax.bar([x + width for x in xs], [ttft["epd"][lb] for lb in labels], width, label="EPD 1E1P1D TTFT p50")
    ax.set_xticks(list(xs), labels, rotation=20)
    ax.set(ylabel="ms", title="Encoder cost vs TTFT, one request at a time")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
