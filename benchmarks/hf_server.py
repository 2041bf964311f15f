"""A transformers ``generate`` server behind EPD's own OpenAI front end: the naive baseline.

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

from epd.models.presets import load_processor, resolve_model  # noqa: E402
from epd.multimodal.messages import extract_images  # noqa: E402
from epd.router.detok import IncrementalDetokenizer  # noqa: E402
from epd.router.http_app import build_app  # noqa: E402
from epd.router.metrics import RouterMetrics  # noqa: E402
from epd.router.types import ChatRequest, RouterError, StreamEvent  # noqa: E402
from epd.serving import READY_PREFIX  # noqa: E402


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


class TransformersCore:
    """A ``RouterCore`` over ``AutoModelForImageTextToText.generate``, one request at a time."""

    def __init__(self, model_dir, model_name: str) -> None:
        self.model_name = model_name
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = load_processor(model_dir)
        self.tokenizer = self.processor.tokenizer
        self.eos_token_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.metrics = RouterMetrics()
        self._one_at_a_time = threading.Lock()

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "mode": "transformers", "workers": {}}

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def generate(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        try:
            messages, images = extract_images(request.messages, allowed_local_root=None)
        except ValueError as err:
            raise RouterError(400, str(err), param="messages") from None
        inputs = self._inputs(messages, images)
        prompt = inputs["input_ids"][0].tolist()
        queue: asyncio.Queue = asyncio.Queue()
        streamer = _QueueStreamer(asyncio.get_running_loop(), queue)
        cancelled = threading.Event()
        worker = asyncio.create_task(asyncio.to_thread(self._generate, inputs, request, streamer, cancelled))
        detok, first, params = IncrementalDetokenizer(self.tokenizer), True, request.sampling
        num_tokens = 0
        try:
            while (tokens := await queue.get()) is not None:
                num_tokens += len(tokens)
                done = num_tokens >= params.max_tokens or (not params.ignore_eos and self.eos_token_id in tokens)
                text = detok.add(tokens) + (detok.flush() if done else "")
                finish = ("length" if num_tokens >= params.max_tokens else "stop") if done else None
                yield StreamEvent(tokens, text, finish_reason=finish, prompt_token_ids=prompt if first else None)
                first = False
        finally:
            cancelled.set()  # a no-op once generate is done; stops it when the client left
            await worker

    def _inputs(self, messages: list[dict], images: list[bytes]) -> dict:
        # extract_images left {"type": "image"} markers where the images were: all the template needs
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        return self.processor(text=[text], images=pil or None, return_tensors="pt")

    def _generate(self, inputs: dict, request: ChatRequest, streamer: _QueueStreamer,
                  cancelled: threading.Event) -> None:
        from transformers import StoppingCriteriaList

        params = request.sampling
        sample = params.temperature > 0
        kwargs = dict(max_new_tokens=params.max_tokens, do_sample=sample, streamer=streamer,
                      stopping_criteria=StoppingCriteriaList([_StopWhenCancelled(cancelled)]),
                      eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id)
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
    core = TransformersCore(resolve_model(args.model), args.model)
    app = build_app(core, tokenizer=core.tokenizer)
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
