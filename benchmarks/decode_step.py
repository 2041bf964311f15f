"""The decode step's own cost: what the engine spends per step around the model (scheduler, block
tables, inputs, sampler, bookkeeping), measured with the zero-cost model (``null-qwen2-vl``: its
forward does no arithmetic) at a full decode batch, in this process.

For each batch size: B text requests admitted and prefilled, then S decode steps timed. Printed:
CPU ms per step (process time, all threads), wall ms per step, and where the wall time went
(scheduler.schedule, runner.prepare, the forward and logits, the sampler, the scheduler's advance
and complete; the rest is the step's own glue). The same numbers for the tiny preset, whose forward
is real, put them beside a model that computes. ``--modes in_order,async``: each point also with
async scheduling (on the CPU nothing runs beside the host, so this shows its bookkeeping's cost),
or ``rebuilt``: in order with every step's inputs read again from the sequences (the engine's
general step, as before it kept its decode batch from step to step).
``--temperature 1``: every row sampled (the OpenAI API's default) instead of greedy. ``--context N``:
prompts of N tokens (every step's sequences span that much KV, as long chats' do). ``--churn imported``:
a decode worker's load, requests imported with their KV and finishing at different steps, each
replaced by a new one; ``--churn prompts``: the same with prompts to prefill (the in-process
engine's load).

    python benchmarks/decode_step.py [--batches 64,256] [--steps 200] [--models null-qwen2-vl,tiny-qwen2-vl]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from control_plane import kv_bytes_per_token  # noqa: E402

from epd.config import EngineConfig  # noqa: E402
from epd.engine.llm_engine import LLMEngine  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.models.registry import load_llm_for  # noqa: E402
from epd.models.tokenizer_loading import load_tokenizer  # noqa: E402
from epd.types import SamplingParams  # noqa: E402

PARTS = (("schedule", "scheduler", "schedule"), ("prepare", "runner", "prepare"), ("forward", "runner", "forward"),
         ("sample", "sampler", "__call__"), ("advance", "scheduler", "advance"), ("complete", "scheduler", "complete"),
         # a step from the decode batch kept from the step before
         ("schedule", "decode_batch", "refresh"), ("schedule", "decode_batch", "take_pages"),
         ("complete", "decode_batch", "advance"), ("schedule", "scheduler", "schedule_beside"))


class Timed:
    """Wall time spent in a few methods of an engine, by name (instance attributes shadow them)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        for name, owner, method in PARTS:
            if method == "forward":
                self._wrap_forward(engine.runner)
            elif method == "__call__":
                engine.sampler = _CallTimer(engine.sampler, self.seconds, name)
            else:
                target = getattr(engine, owner)
                setattr(target, method, self._timer(getattr(target, method), name))

    def _timer(self, fn, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def _wrap_forward(self, runner) -> None:
        model = runner.model
        forward, logits = model.forward, model.compute_logits
        model.forward = self._timer(forward, "forward")
        model.compute_logits = self._timer(logits, "forward")


class _CallTimer:
    """The sampler, timed: drawn on the host (``__call__``) or left on the device (``on_device``)."""

    def __init__(self, inner, seconds, name) -> None:
        self.inner, self.seconds, self.name = inner, seconds, name

    def __call__(self, *args, **kwargs):
        return self._timed(self.inner, *args, **kwargs)

    def on_device(self, *args, **kwargs):
        return self._timed(self.inner.on_device, *args, **kwargs)

    def sample(self, *args, **kwargs):
        return self._timed(self.inner.sample, *args, **kwargs)

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[self.name] += time.perf_counter() - start


class _Arrivals:
    """Requests as a decode worker gets them: the prompt's KV computed elsewhere (zeros here: the
    zero-cost model reads none of it), each with its own length, so some finish at most steps."""

    def __init__(self, engine: LLMEngine, prompt: list[int], steps: int, temperature: float, prompts: bool) -> None:
        import torch
        runner = engine.runner
        k = runner.kv_cache.k[0]
        self.kv = torch.zeros((len(runner.kv_cache.k), 2, len(prompt), runner.num_kv_heads_total, k.shape[2]),
                              dtype=k.dtype)
        self.engine, self.prompt, self.steps, self.temperature = engine, prompt, steps, temperature
        self.count, self.prompts = 0, prompts

    def __call__(self) -> None:
        self.count += 1
        length = 16 + (self.count * 7919) % self.steps  # spread over 16 .. steps + 16 tokens
        params = SamplingParams(max_tokens=length, ignore_eos=True, temperature=self.temperature)
        if self.prompts:  # the in-process engine's (and --aggregated's): prompts to prefill
            self.engine.add_request(self.prompt, params, request_id=f"r{self.count}")
            return
        self.engine.add_imported(self.prompt, params, first_token_id=self.prompt[-1], first_logprobs=None, kv=self.kv,
                                 mm=None, eos_token_ids=(), request_id=f"r{self.count}")


def measure(model: str, batch: int, steps: int, mode: str = "in_order", temperature: float = 0.0,
            context: int = 0, churn: str = "") -> dict:
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    # room for every sequence's whole length: a preemption (and its prefix lookup) is not a decode step
    kv_bytes = max(1 << 30, batch * (context + steps + 128) * kv_bytes_per_token(model))
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 64),
                          kv_cache_bytes=kv_bytes, max_model_len=max(4096, context + steps + 128),
                          async_scheduling=mode == "async")
    engine = LLMEngine(load_llm_for(model_dir, config), config,
                       eos_token_ids=(tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    prompt = tokenizer.encode("Tell me a long story about a benchmark.", add_special_tokens=False)
    if context > len(prompt):  # every sequence's KV this long: what a step's page metadata spans
        prompt = (prompt * (context // len(prompt) + 1))[:context]
    engine.keep_decode_batch = mode != "rebuilt"
    if churn:
        arrive = _Arrivals(engine, prompt, steps, temperature, prompts=churn == "prompts")
        for _ in range(batch):
            arrive()
    else:
        params = SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=temperature)
        for i in range(batch):
            engine.add_request(prompt, params, request_id=f"r{i}")
        while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill every request (and their first tokens)
    for _ in range(5):
        engine.step()  # warm: the decode path's first steps allocate
    timed = Timed(engine)
    cpu, wall, batches = time.process_time(), time.perf_counter(), 0
    for _ in range(steps):
        finished = engine.step()
        batches += len(engine.scheduler.running) + len(finished)
        for _ in finished if churn else ():
            arrive()  # one request arrives for each that finished: the batch stays full
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    running = round(batches / steps)
    parts = {name: 1000 * s / steps for name, s in timed.seconds.items()}
    parts["other"] = 1000 * wall / steps - sum(parts.values())
    return {"model": model, "mode": mode, "batch": running, "cpu_ms": 1000 * cpu / steps, "wall_ms": 1000 * wall / steps,
            "parts": parts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="null-qwen2-vl,tiny-qwen2-vl")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="in_order",
                        help="in_order, async, rebuilt (in order, every step's inputs read from the sequences, as "
                             "before the decode batch was kept from step to step): a comma list")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (a tier on a small host gets 1; the step's own work is serial)")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--context", type=int, default=0,
                        help="prompt tokens per request (default: a one-line prompt); the KV a step spans")
    parser.add_argument("--churn", choices=("imported", "prompts"), default="",
                        help="requests of different lengths, one arriving for each that finishes (the batch printed "
                             "is the mean): imported (a decode worker's: their KV computed elsewhere) or prompts (the "
                             "in-process engine's: prefilled beside the decodes)")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    if set(modes) - {"in_order", "async", "rebuilt"}:
        parser.error(f"--modes: in_order, async and/or rebuilt, got {args.modes!r}")
    print(f"{'model':<15}{'mode':<10}{'batch':>6}{'CPU ms/step':>13}{'wall ms/step':>14}  wall ms by part", flush=True)
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for mode in modes:
                r = measure(model, batch, args.steps, mode=mode, temperature=args.temperature,
                            context=args.context, churn=args.churn)
                parts = " ".join(f"{k}={v:.3f}" for k, v in r["parts"].items())
                print(f"{r['model']:<15}{r['mode']:<10}{r['batch']:>6}{r['cpu_ms']:>13.3f}{r['wall_ms']:>14.3f}  "
                      f"{parts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
