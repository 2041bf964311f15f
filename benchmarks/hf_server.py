"""A transformers ``generate`` server behind EPD's own router pipeline and OpenAI front end: the
naive baseline. Only the backend differs from ``epd serve``: media, preprocessing, detokenization
and stop strings are the router's.

One request at a time (transformers has no continuous batching), greedy or sampled, streamed token
by token through a ``BaseStreamer`` so TTFT and inter-token latency are real. Benchmarks only:
started by ``sweep_serving.py``, it prints ``EPD_READY router http://HOST:PORT`` when serving.

    python benchmarks/hf_server.py --model PRESET_OR_DIR [--host 127.0.0.1] [--port 0]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import threading
from collections.abc import AsyncIterator

import common  # noqa: F401  (puts the checkout on sys.path)
import torch  # noqa: E402
import uvicorn  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from epd.config import RouterConfig  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.models.presets import load_processor  # noqa: E402
from epd.router.backends.base import BackendOutput, Job  # noqa: E402
from epd.router.openai.app import build_app  # noqa: E402
from epd.router.pipeline import RequestPipeline  # noqa: E402
from epd.server.process import READY_PREFIX  # noqa: E402


class _QueueStreamer(BaseStreamer):
    """generate() calls put(prompt ids) once, then put(new token) per step, then end()."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.seen_prompt = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class _StopWhenCancelled:
    """A stopping criterion: the client went away, stop generating."""

    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return self.cancelled.is_set()


class TransformersBackend:
    """A pipeline backend over ``AutoModelForImageTextToText.generate``, one request at a time."""

    def __init__(self, model_dir) -> None:
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = load_processor(model_dir)
        self.embedding_row_bytes = self.model.config.get_text_config().hidden_size * 4
        self._one_at_a_time = threading.Lock()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def health(self) -> dict:
        return {"status": "ok", "mode": "transformers", "workers": {}}

    def refresh_metrics(self, metrics) -> None:
        pass

    async def run(self, job: Job) -> AsyncIterator[BackendOutput]:
        inputs = self._inputs(job)
        queue: asyncio.Queue = asyncio.Queue()
        streamer = _QueueStreamer(asyncio.get_running_loop(), queue)
        cancelled = threading.Event()
        worker = asyncio.create_task(asyncio.to_thread(self._generate, inputs, job, streamer, cancelled))
        params, num_tokens = job.sampling, 0
        try:
            while (tokens := await queue.get()) is not None:
                num_tokens += len(tokens)
                is_eos = not params.ignore_eos and any(t in job.eos_token_ids for t in tokens)
                finish = "length" if num_tokens >= params.max_tokens else ("stop" if is_eos else None)
                yield BackendOutput(tokens, finish_reason=finish)
                if finish:
                    return
        finally:
            cancelled.set()  # a no-op once generate is done; stops it when the client left
            await worker

    def _inputs(self, job: Job) -> dict:
        """The router's own prompt ids (placeholders expanded, as transformers expands them) plus
        the images' pixels from transformers' image processor."""
        inputs = {"input_ids": torch.tensor([job.prompt.prompt_token_ids]),
                  "attention_mask": torch.ones(1, len(job.prompt.prompt_token_ids), dtype=torch.long)}
        if job.prompt.items:
            pil = [Image.open(io.BytesIO(item.data)).convert("RGB") for item in job.prompt.items]
            inputs.update(self.processor.image_processor(images=pil, return_tensors="pt"))
        return inputs

    def _generate(self, inputs: dict, job: Job, streamer: _QueueStreamer, cancelled: threading.Event) -> None:
        from transformers import StoppingCriteriaList

        params = job.sampling
        sample = params.temperature > 0
        kwargs = dict(max_new_tokens=params.max_tokens, do_sample=sample, streamer=streamer,
                      stopping_criteria=StoppingCriteriaList([_StopWhenCancelled(cancelled)]),
                      eos_token_id=list(job.eos_token_ids), pad_token_id=job.eos_token_ids[0])
        if params.ignore_eos:
            kwargs["min_new_tokens"] = params.max_tokens
        if sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        with self._one_at_a_time, torch.inference_mode():
            self.model.generate(**inputs, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen2-vl")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    pipeline = RequestPipeline(model_dir, RouterConfig(model=args.model), TransformersBackend(model_dir))
    app = build_app(pipeline, tokenizer=pipeline.tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))

    async def run() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"{READY_PREFIX} router http://{args.host}:{port}", flush=True)
        await serving

    asyncio.run(run())


if __name__ == "__main__":
    main()
