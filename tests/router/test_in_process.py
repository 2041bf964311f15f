"""The in-process backend (``--aggregated``): a step's updates for every request cross from the
engine thread to the event loop in one call, not one per request per step."""
from __future__ import annotations

import asyncio

from epd.models.locate import resolve_model
from epd.router.backends.in_process import InProcessBackend
from epd.types import ChatRequest, SamplingParams
from tests.router.test_pipeline import make_pipeline

NUM_REQUESTS, NUM_TOKENS = 8, 32


def test_a_steps_updates_cross_to_the_event_loop_in_one_call():
    model_dir = resolve_model("null-qwen2-vl")

    async def main():
        backend = InProcessBackend(model_dir)
        pipeline = make_pipeline(model_dir, backend)
        await pipeline.start()
        loop = asyncio.get_running_loop()
        crossings, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kw: crossings.append(args[0]) or real(*args, **kw)

        async def one(i: int) -> list[int]:
            request = ChatRequest(messages=[{"role": "user", "content": f"Story {i}."}], request_id=f"r{i}",
                                  sampling=SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
            return [t async for event in pipeline.generate(request) for t in event.token_ids]

        try:
            outputs = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
            return outputs, len(crossings), backend.llm.engine.num_steps
        finally:
            loop.call_soon_threadsafe = real
            await pipeline.close()

    outputs, crossings, steps = asyncio.run(main())
    assert [len(tokens) for tokens in outputs] == [NUM_TOKENS] * NUM_REQUESTS
    # one per step, plus a few per request (its admission's future): 8 x 32 = 256 when each update crossed alone
    assert crossings <= steps + 3 * NUM_REQUESTS, (crossings, steps)


def test_a_stream_interval_leaves_the_tokens_in_the_engine_until_a_group_is_complete():
    """``--aggregated --stream-interval 4``: the engine loop holds a request's tokens after its first
    until 4 have come, so they cross to the event loop once a group (the loop's wake-ups divided by
    about 4 against the same requests at 1), and the pipeline's events are the first token alone,
    then 4 each, the last with the rest; the tokens are those of a stream at 1 (the zero-cost model's
    are deterministic)."""
    model_dir = resolve_model("null-qwen2-vl")

    async def main(interval: int):
        backend = InProcessBackend(model_dir, stream_interval=interval)
        pipeline = make_pipeline(model_dir, backend, stream_interval=interval)
        await pipeline.start()
        loop = asyncio.get_running_loop()
        crossings, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kw: crossings.append(args[0]) or real(*args, **kw)
        request = ChatRequest(messages=[{"role": "user", "content": "Story."}], request_id="g",
                              sampling=SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0))
        try:
            events = [event.token_ids async for event in pipeline.generate(request)]
            return events, len(crossings)
        finally:
            loop.call_soon_threadsafe = real
            await pipeline.close()

    (one, crossed_one), (grouped, crossed_grouped) = asyncio.run(main(1)), asyncio.run(main(4))
    assert [t for e in grouped for t in e] == [t for e in one for t in e] and len(one) == NUM_TOKENS
    assert [len(e) for e in grouped] == [1] + [4] * ((NUM_TOKENS - 1) // 4) + [(NUM_TOKENS - 1) % 4]
    assert crossed_grouped * 3 < crossed_one, (crossed_grouped, crossed_one)
