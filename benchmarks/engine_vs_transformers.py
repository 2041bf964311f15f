"""Our in-process engine vs transformers ``generate`` on the same checkpoint and workload.

Workload: N concurrent one-image chats (448x448 noise images, all distinct), O output tokens each
(EOS ignored so every system produces the same number of tokens). Measured in one run:
  * output tokens/s: our engine (continuous batching) vs transformers one request at a time and
    transformers batched (left-padded, one generate call);
  * decode-step time at batch N vs a matmul-only bound: the same weight matmuls (qkv, o, gate_up,
    down per layer, lm_head) on an [N, hidden] input, timed alone.

    python benchmarks/engine_vs_transformers.py [--model small-qwen2-vl] [--num-requests 32] [--output-len 64]
"""
from __future__ import annotations

import argparse
import io
import statistics
import time

import torch
from common import noise_png  # noqa: E402  (also puts the checkout on sys.path)
from PIL import Image

from epd.config import EngineConfig  # noqa: E402
from epd.llm import LLM  # noqa: E402
from epd.models.presets import load_processor, resolve_model  # noqa: E402
from epd.types import SamplingParams  # noqa: E402


def conversation(image: bytes, i: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": f"Request {i}: describe this image."}]}]


def run_ours(llm: LLM, images: list[bytes], output_len: int) -> tuple[float, list[float]]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    step_times, engine = [], llm.engine
    start = time.perf_counter()
    seqs = [llm.add_conversation(conversation(img, i), params) for i, img in enumerate(images)]
    while not all(s.is_finished for s in seqs):
        all_decode = all(not s.is_prefilling for s in engine.scheduler.running) and not engine.scheduler.waiting
        t0 = time.perf_counter()
        engine.step()
        if all_decode and len(engine.scheduler.running) == len(images):
            step_times.append(time.perf_counter() - t0)
    return time.perf_counter() - start, step_times


def hf_inputs(processor, images: list[bytes]):
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Request {i}: describe this image."}]}],
        tokenize=False, add_generation_prompt=True) for i in range(len(images))]
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return texts, pil


@torch.inference_mode()
def run_hf(model, processor, images: list[bytes], output_len: int, batched: bool) -> float:
    texts, pil = hf_inputs(processor, images)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    start = time.perf_counter()
    if batched:
        processor.tokenizer.padding_side = "left"
        inputs = processor(text=texts, images=pil, return_tensors="pt", padding=True)
        model.generate(**inputs, **kwargs)
    else:
        for text, img in zip(texts, pil):
            model.generate(**processor(text=[text], images=[img], return_tensors="pt"), **kwargs)
    return time.perf_counter() - start


@torch.inference_mode()
def matmul_bound_s(llm_model, batch: int, repeats: int = 20) -> float:
    """Time of one decode step's weight matmuls alone (no attention, norms or Python)."""
    weights = [m.weight for layer in llm_model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    weights.append(llm_model.lm_head.weight)
    inputs = [torch.randn(batch, w.shape[1]) for w in weights]
    for x, w in zip(inputs, weights):  # warm up
        x @ w.t()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x, w in zip(inputs, weights):
            x @ w.t()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--skip-sequential", action="store_true", help="skip the slow one-at-a-time baseline")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    images = [noise_png(args.image_size, seed) for seed in range(args.num_requests)]
    total_tokens = args.num_requests * args.output_len

    llm = LLM(str(model_dir), engine_config=EngineConfig(max_num_seqs=args.num_requests,
                                                         max_num_batched_tokens=4096))
    run_ours(llm, images[:2], 4)  # warm up
    ours_s, step_times = run_ours(llm, images, args.output_len)

    from transformers import AutoModelForImageTextToText
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    run_hf(hf, processor, images[:1], 4, batched=False)  # warm up
    hf_seq_s = None if args.skip_sequential else run_hf(hf, processor, images, args.output_len, batched=False)
    hf_batch_s = run_hf(hf, processor, images, args.output_len, batched=True)

    step_s = statistics.median(step_times)
    bound_s = matmul_bound_s(llm.engine.runner.model, args.num_requests)
    print(f"model={args.model} requests={args.num_requests} image={args.image_size}px output_len={args.output_len} "
          f"torch_threads={torch.get_num_threads()}")
    print("| system | wall s | output tok/s | ours / system |")
    print("|---|---|---|---|")
    rows = [("EPD engine (continuous batching)", ours_s), ("transformers batched", hf_batch_s)]
    if hf_seq_s is not None:
        rows.append(("transformers sequential", hf_seq_s))
    for name, secs in rows:
        print(f"| {name} | {secs:.2f} | {total_tokens / secs:.1f} | {secs / ours_s:.2f}x |")
    print(f"decode step at batch {args.num_requests}: {step_s * 1e3:.2f} ms (median of {len(step_times)}); "
          f"matmul-only bound {bound_s * 1e3:.2f} ms; bound/step = {bound_s / step_s:.2f}")
    if hf_seq_s is not None:
        print(f"speedup vs sequential transformers: {hf_seq_s / ours_s:.2f}x (target >= 4)")
    print(f"fraction of matmul bound: {bound_s / step_s:.2f} (target >= 0.5)")


if __name__ == "__main__":
    main()
