"""Our in-process engine vs transformers ``generate`` on the same checkpoint and workload.

Workload: N concurrent one-image chats (448x448 noise images, all distinct), O output tokens each
(EOS ignored so every system produces the same number of tokens). ``--mixed``: N chats with 0-2
images each and output lengths drawn from 16-256 (seeded), what a server sees; transformers'
batched generate runs them as one left-padded batch to the longest. Measured in one run:
  * output tokens/s: our engine (continuous batching) vs transformers one request at a time and
    transformers batched (left-padded, one generate call);
  * decode-step time at batch N vs a matmul-only bound: the same weight matmuls (qkv, o, gate_up,
    down per layer, lm_head) on an [N, hidden] input, timed alone.

    python benchmarks/engine_vs_transformers.py [--model small-qwen2-vl] [--num-requests 32] [--output-len 64]
    python benchmarks/engine_vs_transformers.py --mixed   # last line: the engine / batched-transformers ratio
"""
from __future__ import annotations

import argparse
import io
import random
import statistics
import time

import torch
from common import noise_png  # noqa: E402  (also puts the checkout on sys.path)
from PIL import Image

from epd.config import EngineConfig  # noqa: E402
from epd.llm import LLM  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.models.presets import load_processor  # noqa: E402
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


def mixed_workload(n: int, image_size: int, seed: int = 0) -> list[tuple[list[bytes], int]]:
    """(images, output length) per request: 0-2 distinct noise images, 16-256 tokens."""
    rng = random.Random(seed)
    return [([noise_png(image_size, 1000 * i + k) for k in range(rng.randint(0, 2))], rng.randint(16, 256))
            for i in range(n)]


def mixed_conversation(images: list[bytes], i: int) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": img} for img in images),
                                         {"type": "text", "text": f"Request {i}: describe what you see."}]}]


def run_ours_mixed(llm: LLM, workload) -> float:
    start = time.perf_counter()
    seqs = [llm.add_conversation(mixed_conversation(images, i), SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (images, n) in enumerate(workload)]
    llm.engine.run_until_done(seqs)
    assert [len(s.token_ids) - s.num_prompt_tokens for s in seqs] == [n for _, n in workload]
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf_mixed(model, processor, workload) -> float:
    """One left-padded batch to the longest output (generate cannot stop rows at their own lengths)."""
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                      {"type": "text", "text": f"Request {i}: describe what you see."}]}],
        tokenize=False, add_generation_prompt=True) for i, (images, _) in enumerate(workload)]
    pil = [Image.open(io.BytesIO(img)).convert("RGB") for images, _ in workload for img in images]
    longest = max(n for _, n in workload)
    start = time.perf_counter()
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=pil or None, return_tensors="pt", padding=True)
    model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
    return time.perf_counter() - start


def main_mixed(args, model_dir) -> None:
    workload = mixed_workload(args.num_requests, args.image_size // 2)
    useful = sum(n for _, n in workload)
    llm = LLM(str(model_dir), engine_config=EngineConfig(max_num_seqs=args.num_requests, max_num_batched_tokens=4096))
    run_ours_mixed(llm, mixed_workload(2, 56, seed=99))  # warm up
    ours_s = run_ours_mixed(llm, workload)
    from transformers import AutoModelForImageTextToText
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    run_hf_mixed(hf, processor, mixed_workload(2, 56, seed=99))  # warm up
    hf_s = run_hf_mixed(hf, processor, workload)
    images = sum(len(i) for i, _ in workload)
    print(f"model={args.model} mixed: {args.num_requests} requests, {images} images of {args.image_size // 2}px, "
          f"outputs 16-256 ({useful} tokens), torch_threads={torch.get_num_threads()}")
    print("| system | wall s | output tok/s |")
    print("|---|---|---|")
    for name, secs in (("EPD engine (continuous batching)", ours_s), ("transformers batched", hf_s)):
        print(f"| {name} | {secs:.2f} | {useful / secs:.1f} |")
    print(f"mixed workload: engine / transformers batched = {hf_s / ours_s:.2f}x (target >= 1.5)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--skip-sequential", action="store_true", help="skip the slow one-at-a-time baseline")
    ap.add_argument("--mixed", action="store_true", help="0-2 images and 16-256 output tokens per request")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    if args.mixed:
        return main_mixed(args, model_dir)
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
    print(f"fraction of matmul bound: {bound_s / step_s:.2f} (target >= 0.85)")


if __name__ == "__main__":
    main()
