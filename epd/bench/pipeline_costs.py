"""``epd profile --pipeline``: what the serving path costs beyond the stages themselves, measured on
a real ``epd serve`` here (the tiers, then ``--aggregated``) with one request at a time: the hops
between processes, HTTP and streaming. For each: the TTFT of a text request and of one with an image,
and the time per output token, minus what the profile's stage costs account for (a prefill of that
prompt, the encoder's forward, a decode step), as three figures a simulator adds:

- ``request_ms``: on every request's way to its first token;
- ``image_ms``: per image, on its way from the router to prefill (the encode call and the push);
- ``step_ms``: per decode step, on the decode worker (its output path);
- ``token_ms``: per streamed token, on the host beside the tiers (the router's work, the stream's),
  told from ``step_ms`` by the time per token of one stream against that of ``_STREAMS`` at once;
- ``wake``: how much longer a request's first token takes when it finds the whole cluster idle since
  a while, text and with an image (a virtual host's processes start cold: caches, descheduled CPUs).
"""
from __future__ import annotations

import base64
import json
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass

from epd.bench.local_server import LocalServer

_REQUESTS = 12
_OUTPUT_TOKENS = 16
_IDLE_GAPS_S = (0.1, 0.5, 2.0)
_WAKE_REQUESTS = 4
_STREAMS = 4


def _one(url: str, model: str, image: bytes | None) -> tuple[float, float, int]:
    """-> (TTFT ms, ms per output token after the first, prompt tokens) of one streamed request."""
    content = [{"type": "text", "text": "Describe what you see in a few words, please, and be brief."}]
    if image is not None:
        content.insert(0, {"type": "image_url",
                           "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}})
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": _OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    start, times, prompt_tokens = time.perf_counter(), [], 0
    with urllib.request.urlopen(request, timeout=120) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    ttft_ms = 1000 * (times[0] - start)
    return ttft_ms, 1000 * (times[-1] - times[0]) / max(len(times) - 1, 1), prompt_tokens


def _after_idle(url: str, model: str, gap_s: float, picture) -> tuple[float, float]:
    """Median TTFT (text, image) of requests each sent after the cluster idled ``gap_s``."""
    text, image = [], []
    for _ in range(_WAKE_REQUESTS):
        time.sleep(gap_s)
        text.append(_one(url, model, None)[0])
        time.sleep(gap_s)
        image.append(_one(url, model, next(picture))[0])
    return statistics.median(text), statistics.median(image)


def _concurrent_ms_per_token(url: str, model: str) -> float:
    """The median time per output token of ``_STREAMS`` text requests sent at once (three rounds)."""
    from concurrent.futures import ThreadPoolExecutor

    per_token = []
    with ThreadPoolExecutor(_STREAMS) as pool:
        for _ in range(3):
            per_token += [s for _, s, _ in pool.map(lambda _: _one(url, model, None), range(_STREAMS))]
    return statistics.median(per_token)


@dataclass
class Measured:
    """What one serving path showed, one request at a time (ms)."""

    ttft_text: float
    ttft_image: float
    tokens_text: int  # prompt tokens of the text request
    tokens_image: int  # and of the one with an image
    per_token: float  # time per output token of one stream
    per_token_crowded: float  # of each of _STREAMS streams at once
    after_idle: dict  # idle seconds -> (TTFT text, TTFT image) after idling that long


def derive(costs, m: Measured, image_px: int) -> dict:
    """The path's own costs: what was measured less what the profile's stages account for."""
    request_ms = m.ttft_text - costs.prefill_ms(m.tokens_text) - costs.router_ms(0, 0.0)
    image_ms = (m.ttft_image - m.ttft_text - costs.encoder_ms(image_px ** 2, 1)
                - (costs.prefill_ms(m.tokens_image) - costs.prefill_ms(m.tokens_text)))
    context = m.tokens_text + _OUTPUT_TOKENS / 2
    alone = m.per_token - costs.decode_ms(1, context)  # one step, one token: the path's per step and per token
    crowded = m.per_token_crowded - costs.decode_ms(_STREAMS, context)  # one step, _STREAMS tokens
    token_ms = max((crowded - alone) / (_STREAMS - 1), 0.0)
    return {"request_ms": round(max(request_ms, 0.0), 3), "image_ms": round(max(image_ms, 0.0), 3),
            "step_ms": round(max(alone - token_ms, 0.0), 3), "token_ms": round(token_ms, 3),
            "wake": [{"idle_s": gap, "text_ms": round(max(t - m.ttft_text, 0.0), 3),
                      "image_ms": round(max(i - m.ttft_image, 0.0), 3)} for gap, (t, i) in m.after_idle.items()],
            "measured": {"ttft_text_ms": round(m.ttft_text, 2), "ttft_image_ms": round(m.ttft_image, 2),
                         "ms_per_token": round(m.per_token, 3),
                         f"ms_per_token_{_STREAMS}_streams": round(m.per_token_crowded, 3),
                         "prompt_tokens": [m.tokens_text, m.tokens_image]}}


def measure(model: str, costs, image_px: int = 448) -> dict:
    """{"epd": {...}, "aggregated": {...}}: each path's ``request_ms``, ``image_ms``, ``step_ms``;
    ``costs``: this profile's ``epd.plan.costs.StageCosts`` (what the stages account for)."""
    from epd.bench.workload import ImageSpec, render_image

    out = {}
    for name, flags in (("epd", ()), ("aggregated", ("--aggregated",))):
        picture = iter(render_image(ImageSpec(image_px, image_px, seed)) for seed in range(1 << 20))
        command = [sys.executable, "-m", "epd", "serve", "--model", model, "--port", "0", "--grpc-port", "0",
                   "--no-standby", *flags]
        with LocalServer(command, name=f"epd serve {' '.join(flags)}") as serve:
            text = [_one(serve.url, model, None) for _ in range(_REQUESTS)][2:]
            image = [_one(serve.url, model, next(picture)) for _ in range(_REQUESTS)][2:]
            after_idle = {gap: _after_idle(serve.url, model, gap, picture) for gap in _IDLE_GAPS_S}
            crowded_ms = _concurrent_ms_per_token(serve.url, model)
        ttft_text, ttft_image = (statistics.median(t for t, _, _ in runs) for runs in (text, image))
        out[name] = derive(costs, Measured(ttft_text, ttft_image, text[-1][2], image[-1][2],
                                           statistics.median(s for _, s, _ in text + image), crowded_ms,
                                           after_idle), image_px)
    return out
