"""A GPU profile for ``epd plan`` before any GPU run made one: Qwen2.5-VL-7B on one H100 SXM,
estimated from published figures (the model's configuration, the GPU's datasheet), not measured.

Stages by roofline, with the efficiencies serving stacks commonly reach (assumptions, stated here):
- vision tower (675M parameters, 14 px patches) and prefill (7.6B): compute bound, 2 FLOPs per
  parameter per token plus attention, at 50% of the H100's 989 dense BF16 TFLOPS;
- a decode step: reads the weights (15.2 GB) and the batch's KV once, at 70% of 3.35 TB/s, or its
  FLOPs at 50% when the batch makes it compute bound, whichever is longer;
- a fixed launch cost per forward (1 ms vision, 2 ms prefill, 0.4 ms decode with CUDA graphs);
- hand-offs: CUDA IPC on one host (NVLink), NCCL across hosts at 50 GB/s (400 Gb/s);
- the router and the serving path: figures of this project's CPU runs, scaled down for a server CPU.

    python benchmarks/roofline_profile.py --out docs/profiles/h100-qwen2.5-vl-7b-roofline.json

Replace it with ``epd profile`` on the GPU (scripts/gpu_verify.sh runs it) once one ran.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TFLOPS, HBM_TBPS = 989e12, 3.35e12
MFU, MBU = 0.5, 0.7
LLM_PARAMS, VIT_PARAMS = 7.6e9, 0.675e9
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 28, 3584, 4, 128
VIT_LAYERS, VIT_HIDDEN, PATCH_PX = 32, 1280, 14
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # bf16


def vision_ms(image_px: int, batch: int) -> float:
    patches = (image_px // PATCH_PX) ** 2
    flops = 2 * VIT_PARAMS * patches + 4 * VIT_LAYERS * patches ** 2 * VIT_HIDDEN
    return 1000 * flops / (MFU * TFLOPS) + 1.0 / batch


def prefill_ms(tokens: int) -> float:
    flops = 2 * LLM_PARAMS * tokens + 4 * LAYERS * tokens ** 2 * HIDDEN / 2  # causal: half the square
    return 1000 * flops / (MFU * TFLOPS) + 2.0


def decode_ms(batch: int, context: int) -> float:
    memory_s = (2 * LLM_PARAMS + batch * context * KV_BYTES_PER_TOKEN) / (MBU * HBM_TBPS)
    compute_s = 2 * LLM_PARAMS * batch / (MFU * TFLOPS)
    return 1000 * max(memory_s, compute_s) + 0.4


def profile() -> dict:
    return {
        "model": "Qwen2.5-VL-7B-Instruct (estimated)", "device": "cuda (H100 SXM, roofline estimate)",
        "host": {"cpus": 32, "threads": 1, "estimated": True, "source": "benchmarks/roofline_profile.py"},
        "encoder": [{"image_px": px, "batch": b, "ms_per_item": round(vision_ms(px, b), 3)}
                    for px in (224, 448, 896) for b in (1, 8, 32)],
        "prefill": [{"prompt_tokens": n, "prefix_cached": cached, "ms_total": round(prefill_ms(8 if cached else n), 3),
                     "chunk_tokens": 8192} for n in (256, 1024, 4096, 8192) for cached in (False, True)],
        "decode": [{"batch": b, "context_tokens": c, "ms_per_step": round(decode_ms(b, c), 3)}
                   for b in (1, 16, 64, 256) for c in (1024, 4096)],
        "transfer": [{"transport": "cuda_ipc", "mb": mb, "ms_per_mb": round(0.3 / mb + 1 / 400, 4)} for mb in (1, 64)]
        + [{"transport": "nccl", "mb": mb, "ms_per_mb": round(0.5 / mb + 1 / 50, 4)} for mb in (1, 64)],
        "router": [{"image_px": px, "ms_per_request": ms} for px, ms in ((224, 0.3), (896, 0.6))],
        "pipeline": {name: {"request_ms": 3.0, "image_ms": 1.0, "step_ms": 0.2, "wake": []}
                     for name in ("epd", "aggregated")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/profiles/h100-qwen2.5-vl-7b-roofline.json")
    args = ap.parse_args()
    Path(args.out).write_text(json.dumps(profile(), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
