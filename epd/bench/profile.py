"""``epd profile``: what each stage of EPD costs on this machine, for one model, as one JSON file (the
input a cluster simulator or a planner starts from).

Measured in this process, each point a median of ``--repeats`` runs after a warm-up:
- encoder: ms per item by image size and batch (distinct images: no cache hit), through the
  encoder engine the workers run;
- prefill: ms per chunk by prompt length, cold and with the prompt's prefix cached (a second request
  sharing all but its last block);
- decode: ms per step by batch and context length, greedy and sampled (temperature 1);
- transfer: ms per MB of handing a tensor over by each transport this host has (export + import);
- router: ms per request before dispatch (body, image, chat template, hash) by image size;
- wake: the extra ms of the first work after idling, by how long (a virtual host's cold start);
- with ``--pipeline``: the serving path's own costs per request, per image and per decode step, on a
  real ``epd serve`` here (``epd.bench.pipeline_costs``).

    epd profile [--model tiny-qwen2-vl] [--out profile.json] [--device auto]
        [--image-sizes 224,448] [--encoder-batches 1,4] [--prefill-lengths 256,1024]
        [--decode-batches 1,2,4,8,16,32] [--contexts 256,1024] [--transfer-mb 1,16] [--repeats 3] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_WARM_STEPS = 5  # decode steps run before each decode point is timed


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _median_s(run, repeats: int) -> float:
    run()  # warm: first calls allocate and compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_encoder(model_dir, device: str, sizes: list[int], batches: list[int], repeats: int) -> list[dict]:
    from epd.bench.workload import ImageSpec, render_image
    from epd.config import EncoderConfig
    from epd.encoder.engine import EncoderEngine

    engine = EncoderEngine.from_model_dir(model_dir, EncoderConfig(device=device, encoder_batch_size=max(batches)))
    seed = iter(range(1 << 30))
    points = []
    try:
        for size in sizes:
            for batch in batches:
                # rendered before the clock starts: a client makes its images, the encoder decodes them
                images = iter([render_image(ImageSpec(size, size, next(seed), "noise"))
                               for _ in range(batch * (repeats + 1))])

                def run() -> None:
                    items = [engine.make_item(next(images)) for _ in range(batch)]
                    name = f"p{next(seed)}"
                    engine.submit(name, items, hold_until_release=False).result(timeout=600)

                seconds = _median_s(run, repeats)
                points.append({"image_px": size, "batch": batch, "ms_per_item": round(1000 * seconds / batch, 3)})
    finally:
        engine.close()
    return points


def _llm_engine(model_dir, device: str, max_batch: int, max_len: int):
    from epd.config import EngineConfig
    from epd.engine.llm_engine import LLMEngine
    from epd.models.registry import load_llm_for

    # room for every sequence's whole length at once: the batch measured is the batch asked for
    blocks_per_seq = -(-(max_len + 64) // 16)
    config = EngineConfig(device=device, max_num_seqs=max(max_batch, 8), max_num_batched_tokens=2048,
                          max_model_len=max_len + 64, block_size=16, num_kv_blocks=max(max_batch, 8) * blocks_per_seq)
    return LLMEngine(load_llm_for(model_dir, config), config, eos_token_ids=())


def profile_prefill(model_dir, device: str, lengths: list[int], repeats: int) -> list[dict]:
    """Each prompt to its first token, cold (a prompt never seen) and with its prefix cached (the
    same prompt sent just before, untimed: all but its last block come from the prefix cache)."""
    from epd.types import SamplingParams

    engine = _llm_engine(model_dir, device, 1, max(lengths))
    chunk = engine.config.max_num_batched_tokens
    counter = iter(range(1 << 30))
    one = SamplingParams(max_tokens=1)
    points = []
    for length in lengths:
        for cached in (False, True):
            times = []
            for _ in range(repeats + 1):  # the first: warm-up
                n = next(counter)
                prompt = [1000 + n % 30000] + [1001 + (i % 5000) for i in range(length - 1)]  # a prefix never seen
                if cached:
                    _run_to_first_token(engine, prompt, f"w{n}", one)
                start = time.perf_counter()
                _run_to_first_token(engine, prompt, f"p{n}", one)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
            chunks = -(-length // chunk)
            points.append({"prompt_tokens": length, "prefix_cached": cached, "ms_total": round(1000 * seconds, 3),
                           "ms_per_chunk": round(1000 * seconds / chunks, 3), "chunk_tokens": chunk})
    return points


def _run_to_first_token(engine, prompt: list[int], request_id: str, params) -> None:
    seq = engine.add_request(prompt, params, request_id=request_id)
    while not seq.is_finished:
        engine.step()


def profile_decode(model_dir, device: str, batches: list[int], contexts: list[int], steps: int,
                   temperatures: tuple[float, ...] = (0.0, 1.0)) -> list[dict]:
    """ms per step by batch and context, greedy (temperature 0) and sampled (1, the OpenAI API's
    default, what a client that sends none gets: a softmax and a draw over the vocabulary per row,
    on the CPU a visible share of a small model's step)."""
    from epd.types import SamplingParams

    points = []
    for context in contexts:
        engine = _llm_engine(model_dir, device, max(batches), context + steps + 16)
        for batch, temperature in ((b, t) for b in batches for t in temperatures):
            # past the steps timed and the ones spent prefilling the batch (chunked: decodes run beside them)
            params = SamplingParams(max_tokens=steps + 16 + _WARM_STEPS + batch * context // 2048, ignore_eos=True,
                                    temperature=temperature)
            seqs = [engine.add_request([1000 + (b % 997)] + [1001 + (i % 5000) for i in range(context - 1)], params,
                                       request_id=f"d{context}-{batch}-{temperature}-{b}") for b in range(batch)]
            while any(not s.output_token_ids for s in seqs):
                engine.step()  # every request prefilled and decoding
            for _ in range(_WARM_STEPS):
                engine.step()  # a batch's first steps allocate (the first point measured paid it: up to 2x)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)  # a step that a collection or the host stalled is no step's cost
            for s in seqs:
                engine.abort(s)
            while engine.has_unfinished:
                engine.step()
            points.append({"batch": batch, "context_tokens": context, "temperature": temperature,
                           "ms_per_step": round(1000 * seconds, 3)})
    return points


def model_shapes(model_dir, device: str) -> dict:
    """The bytes a hand-off moves: one embedding row (float32, as encoders send them) and one
    token's KV over every layer (in the engine's dtype: bfloat16 on CUDA, float32 on the CPU)."""
    from epd.models.checkpoint import read_config
    from epd.models.registry import family_for

    hf = read_config(model_dir)
    text = {**hf, **hf.get("text_config", {})}
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_itemsize = 2 if device.startswith("cuda") else 4
    return {"row_bytes": 4 * family_for(model_dir).mm_spec(model_dir).embedding_dim,
            "kv_bytes_per_token": 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * kv_itemsize}


def profile_wake(model_dir, device: str, gaps_s: list[float], repeats: int) -> list[dict]:
    """What a process pays to start working again after idling: the extra ms of one engine step (and
    of a few hundred µs of plain Python, the router's kind of work) run right after sleeping each gap,
    over the same work warm. Near zero on a dedicated host; on a shared or virtual one (this
    project's CI machine) tens of ms after a second of idling, which a simulator must add where a
    worker wakes up."""
    import json as json_module

    from epd.types import SamplingParams

    engine = _llm_engine(model_dir, device, 1, 64 + 64 * len(gaps_s) * (repeats + 2) + 64)
    engine.add_request([1000 + i for i in range(64)], SamplingParams(
        max_tokens=64 * len(gaps_s) * (repeats + 2), ignore_eos=True, temperature=0.0), request_id="wake")

    def step_ms() -> float:
        start = time.perf_counter()
        engine.step()
        return 1000 * (time.perf_counter() - start)

    def python_ms() -> float:
        start = time.perf_counter()
        json_module.loads(json_module.dumps({"tokens": list(range(2000))}))
        return 1000 * (time.perf_counter() - start)

    for _ in range(20):
        step_ms(), python_ms()
    warm_step = statistics.median(step_ms() for _ in range(20))
    warm_python = statistics.median(python_ms() for _ in range(20))
    points = []
    for gap in gaps_s:
        steps, pythons = [], []
        for _ in range(repeats):
            time.sleep(gap)
            steps.append(step_ms())
            time.sleep(gap)
            pythons.append(python_ms())
        points.append({"idle_s": gap, "step_extra_ms": round(max(0.0, statistics.median(steps) - warm_step), 3),
                       "python_extra_ms": round(max(0.0, statistics.median(pythons) - warm_python), 3)})
    return points


def profile_router(model_dir, sizes: list[int], repeats: int) -> list[dict]:
    """What the router spends on one chat request with one image before it dispatches it: the JSON
    body parsed, the image's data URL decoded, the chat template, ids, geometry and content hash."""
    import base64

    import orjson

    from epd.bench.workload import ImageSpec, render_image
    from epd.models.registry import family_for
    from epd.models.tokenizer_loading import load_tokenizer
    from epd.multimodal.messages import extract_media

    processor = family_for(model_dir).input_processor(model_dir, load_tokenizer(model_dir))
    points = []
    for size in sizes:
        bodies = iter([orjson.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
                render_image(ImageSpec(size, size, seed))).decode()}},
            {"type": "text", "text": "Describe the picture in a few words, please."}]}]})
            for seed in range(repeats + 1)])

        def run() -> None:
            conversation, media = extract_media(orjson.loads(next(bodies))["messages"])
            processor.process_messages(conversation, media)

        points.append({"image_px": size, "ms_per_request": round(1000 * _median_s(run, repeats), 3)})
    return points


def profile_transfer(sizes_mb: list[int], repeats: int) -> list[dict]:
    """A tensor exported and imported (read once) by each transport, its lease released over the
    store's own gRPC server, as between two processes of one host (inline: as between hosts)."""
    import torch

    from epd.transport import TensorStore, close_all, import_tensor, serve_tensor_store

    store = TensorStore(shm_pool_bytes=2 * max(sizes_mb) * 2**20)
    server = serve_tensor_store(store)
    points = []
    try:
        for transport in ("shm", "inline"):
            for mb in sizes_mb:
                tensor = torch.rand(mb * 2**20 // 4)

                def run() -> None:
                    imported = import_tensor(store.export(tensor, transport=transport, ttl_s=60))
                    imported.tensor.sum()  # the consumer's first read
                    imported.release()

                seconds = _median_s(run, repeats)
                points.append({"transport": transport, "mb": mb, "ms_per_mb": round(1000 * seconds / mb, 4)})
    finally:
        server.stop(0)
        store.close()
        close_all()
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen2-vl")
    parser.add_argument("--out", default="profile.json")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--image-sizes", default="224,448")
    parser.add_argument("--encoder-batches", default="1,4")
    parser.add_argument("--prefill-lengths", default="256,1024")
    # every power of two up to 32: a step's cost is not linear in its batch (the tiny preset on a CPU
    # here: 4.1 ms at 1, 10.8 at 4, 11.3 at 8, its matmuls changing kernels between), and a light
    # load decodes at 1-4, where interpolating between 1 and 8 was 30% off
    parser.add_argument("--decode-batches", default="1,2,4,8,16,32")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--transfer-mb", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-gaps", default="0.02,0.1,0.5,2",
                        help="seconds of idling after which the cost of waking up is measured")
    parser.add_argument("--pipeline", action="store_true",
                        help="also measure the serving path's own costs on a real epd serve here (tiers and "
                             "--aggregated, one request at a time): what a simulator adds to the stages")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (default: torch's); give what each worker gets to simulate a cluster "
                             "(epd serve on N cores: its banner's threads each)")
    args = parser.parse_args(argv)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from epd.config import resolve_device
    from epd.models.locate import resolve_model

    try:
        model_dir = resolve_model(args.model)
    except ValueError as err:
        print(f"epd profile: error: {err}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    started = time.perf_counter()
    result = {"model": args.model, "device": device, "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                                               "python": platform.python_version(),
                                                               "threads": torch.get_num_threads()}}
    result["shapes"] = model_shapes(model_dir, device)
    result["encoder"] = profile_encoder(model_dir, device, _ints(args.image_sizes), _ints(args.encoder_batches),
                                        args.repeats)
    result["prefill"] = profile_prefill(model_dir, device, _ints(args.prefill_lengths), args.repeats)
    result["decode"] = profile_decode(model_dir, device, _ints(args.decode_batches), _ints(args.contexts),
                                      args.decode_steps)
    result["transfer"] = profile_transfer(_ints(args.transfer_mb), args.repeats)
    result["router"] = profile_router(model_dir, _ints(args.image_sizes), args.repeats)
    result["wake"] = profile_wake(model_dir, device, [float(g) for g in args.idle_gaps.split(",")], args.repeats)
    if args.pipeline:
        from epd.bench.pipeline_costs import measure
        from epd.plan.costs import StageCosts

        result["pipeline"] = measure(args.model, StageCosts.from_profile(result))
    result["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"epd profile: {args.model} on {device}, {result['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
