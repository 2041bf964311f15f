"""Drivers that send one benchmark request and time it: the OpenAI HTTP API (streaming SSE over
httpx) and the public gRPC API (``epd.client.AsyncEPDClient``). Each fills a ``RequestRecord``
in place, so a request cancelled at the run's deadline keeps what it had measured."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from epd.bench.workload import RequestSpec, data_url


@dataclass
class RequestRecord:
    index: int
    rate: float  # the run's request rate (inf: all at once)
    scheduled_s: float  # planned send time, seconds after the run started
    num_images: int = 0
    num_repeated_images: int = 0
    start_s: float | None = None  # when the request went out, seconds after the run started
    status: str = "pending"  # ok | failed | cancelled | pending
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between token-bearing chunks after the first
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; 0 for a one-token output."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 1:
            return None
        if self.output_tokens == 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        out = asdict(self)
        out["rate"] = _json_float(self.rate)
        out["tpot_s"] = self.tpot_s
        return out


def _json_float(value: float) -> float | str:
    return "inf" if value == float("inf") else value


class _Timer:
    """Marks token arrivals of one request against the run's clock."""

    def __init__(self, record: RequestRecord, run_t0: float) -> None:
        self.record, self.t0 = record, time.perf_counter()
        record.start_s = self.t0 - run_t0
        self.last: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_s = now - self.t0
        else:
            self.record.itl_s.append(now - self.last)
        self.last = now
        self.record.output_tokens += count

    def end(self) -> None:
        self.record.e2e_s = time.perf_counter() - self.t0


class OpenAIDriver:
    """Streams ``POST {base}/v1/chat/completions``. Asks for ``ignore_eos`` and ``max_tokens`` so
    outputs have the requested length, ``return_token_ids`` so a chunk's token count is exact (a
    server that ignores it is counted one token per text chunk, then corrected by the usage)."""

    name = "openai"

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, extra_body: dict | None = None, transport=None,
                 text_first: bool = False) -> None:
        import httpx

        self.base_url = normalize_base_url(base_url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits,
                                         timeout=httpx.Timeout(timeout_s, connect=30.0), transport=transport)
        self.extra_body = dict(extra_body or {})
        self.text_first = text_first

    async def resolve_model(self) -> str:
        if self.model is None:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            models = resp.json().get("data") or []
            if not models:
                raise RuntimeError(f"{self.base_url}/v1/models lists no model; pass --model")
            self.model = models[0]["id"]
        return self.model

    def body(self, spec: RequestSpec) -> dict:
        images = [{"type": "image_url", "image_url": {"url": data_url(x) if isinstance(x, bytes) else x}}
                  for x in spec.image_inputs]
        text = [{"type": "text", "text": spec.prompt}]
        content = text + images if self.text_first else images + text
        return {"model": self.model or "default", "messages": [{"role": "user", "content": content}],
                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": spec.output_len,
                "ignore_eos": True, "return_token_ids": True, **self.extra_body}

    async def send(self, spec: RequestSpec, record: RequestRecord, run_t0: float) -> None:
        timer = _Timer(record, run_t0)
        counted, usage = 0, None
        try:
            async with self._client.stream("POST", "/v1/chat/completions", json=self.body(spec)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    record.status, record.error = "failed", f"HTTP {resp.status_code}: {_error_message(text)}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.status, record.error = "failed", f"stream error: {_error_message(chunk)}"
                        return
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        token_ids = choice.get("token_ids")
                        content = (choice.get("delta") or {}).get("content")
                        n = len(token_ids) if token_ids is not None else (1 if content else 0)
                        timer.tokens(n)
                        counted += n
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
            timer.end()
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
                if usage.get("completion_tokens") is not None:
                    record.output_tokens = int(usage["completion_tokens"])
            if record.ttft_s is None:
                record.status, record.error = "failed", "the stream ended without any output token"
            else:
                record.status = "ok"
        except Exception as exc:  # connection errors, bad JSON: the request failed, the run goes on
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"

    async def aclose(self) -> None:
        await self._client.aclose()


class GrpcDriver:
    """Streams ``Router.Generate`` through ``epd.client.AsyncEPDClient``, images as bytes."""

    name = "grpc"

    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        from epd.client import AsyncEPDClient

        self.address, self.timeout_s = address, timeout_s
        # no retries: a load generator reports an overloaded answer, it does not hide it
        self._client = AsyncEPDClient(address, timeout_s=timeout_s, max_retries=0)
        self.model: str | None = None

    async def resolve_model(self) -> str:
        if self.model is None:
            models = await self._client.models()
            self.model = models[0] if models else "default"
        return self.model

    def _stream(self, spec: RequestSpec):
        return self._client.stream(spec.prompt, images=list(spec.image_inputs), max_tokens=spec.output_len,
                                   ignore_eos=True, timeout_s=self.timeout_s)

    async def send(self, spec: RequestSpec, record: RequestRecord, run_t0: float) -> None:
        timer = _Timer(record, run_t0)
        try:
            async with self._stream(spec) as deltas:
                async for delta in deltas:
                    if delta.prompt_token_ids is not None:
                        record.prompt_tokens = len(delta.prompt_token_ids)
                        record.cached_tokens = delta.num_cached_tokens
                    timer.tokens(len(delta.token_ids))
                    if delta.finish_reason:
                        record.finish_reason = delta.finish_reason
            timer.end()
            if record.ttft_s is None:
                record.status, record.error = "failed", "the stream ended without any output token"
            else:
                record.status = "ok"
        except Exception as exc:  # EPDError and friends: a failed request, not a failed run
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"

    async def aclose(self) -> None:
        await self._client.close()


def normalize_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/``, ``http://h:p/v1`` -> ``http://h:p``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


def _error_message(payload) -> str:
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload.strip()[:300]
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err if err is not None else payload)[:300]
