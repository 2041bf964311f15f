"""The client ``epd profile --pipeline`` measures the serving path through (``epd.bench.pipeline_costs``):
``epd bench``'s own driver on an event loop of its own, sending one request, several at once, or a
paced stream, and timing each as a bench run does."""
from __future__ import annotations

import asyncio
import time

OUTPUT_TOKENS = 16  # a request's output tokens unless told (ignore_eos: exactly that many)


class PipelineClient:
    """``epd bench``'s own client (its OpenAI driver, on an event loop of its own), so what is
    measured here is what a bench run's requests cost, its client's work included. Requests as the
    bench makes them: no temperature (the API's default 1: sampled), ``max_tokens`` with
    ``ignore_eos``, token ids in the stream."""

    _PROMPT = "Describe what you see in a few words, please, and be brief."

    def __init__(self, url: str, model: str) -> None:
        from epd.bench.client import OpenAIDriver

        self.loop = asyncio.new_event_loop()
        self.driver = OpenAIDriver(url, model=model)
        self._index = 0

    def close(self) -> None:
        self.loop.run_until_complete(self.driver.aclose())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())  # streams left at their [DONE]
        self.loop.close()

    def one(self, image: bytes | None, max_tokens: int = OUTPUT_TOKENS) -> tuple[float, float, int]:
        """-> (TTFT ms, ms per output token after the first, prompt tokens) of one streamed request."""
        return self.loop.run_until_complete(self._send(image, max_tokens))

    def at_once(self, n: int, images: list[bytes] | None = None,
                max_tokens: int = OUTPUT_TOKENS) -> list[tuple[float, float, int]]:
        """``n`` text requests sent at once, or one per image of ``images``."""
        async def all_of_them():
            return await asyncio.gather(*(self._send(image, max_tokens) for image in images or [None] * n))
        return self.loop.run_until_complete(all_of_them())

    def paced(self, n: int, interval_s: float, images: list[bytes] | None = None,
              max_tokens: int = OUTPUT_TOKENS) -> float:
        """``n`` text requests (or one per image of ``images``), each sent ``interval_s`` after the
        one before whether or not it finished -> their mean decode batch: how many of them were
        between their first and last token at once, over the time any was."""
        async def stream():
            sent = []
            for image in images or [None] * n:
                sent.append(asyncio.ensure_future(self._timed(image, max_tokens)))
                await asyncio.sleep(interval_s)
            return await asyncio.gather(*sent)
        return mean_overlap([(start + ttft / 1000, start + (ttft + (max_tokens - 1) * tpot) / 1000)
                              for start, (ttft, tpot, _) in self.loop.run_until_complete(stream())])

    async def _send(self, image: bytes | None, max_tokens: int) -> tuple[float, float, int]:
        return (await self._timed(image, max_tokens))[1]

    async def _timed(self, image: bytes | None, max_tokens: int) -> tuple[float, tuple[float, float, int]]:
        """-> (when it was sent, s; (TTFT ms, ms per output token after the first, prompt tokens))."""
        from epd.bench.client import RequestRecord
        from epd.bench.workload import RequestSpec

        self._index += 1
        spec = RequestSpec(self._index, self._PROMPT, [], max_tokens, 0.0, [image] if image is not None else [])
        record = RequestRecord(index=self._index, rate=0.0, scheduled_s=0.0)
        start = time.perf_counter()
        await self.driver.send(spec, record, start)
        if not record.ok:
            raise RuntimeError(f"a pipeline request failed: {record.error}")
        return start, (1000 * record.ttft_s, 1000 * (record.tpot_s or 0.0), record.prompt_tokens or 0)


def mean_overlap(spans: list[tuple[float, float]]) -> float:
    """How many of ``spans`` (start, end) were open at once on average over the time any was."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        covered += max(end - max(start, reach), 0.0)
        reach = max(reach, end)
    return sum(end - start for start, end in spans) / covered if covered > 0 else 1.0
