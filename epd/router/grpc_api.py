"""The router's public gRPC face (``proto/epd/v1/router.proto``): translates proto <-> ChatRequest /
StreamEvent over a RouterCore and delegates; RouterError becomes a gRPC status.

Image parts are resolved to bytes here (``data:`` and ``file:`` URLs, the latter only under the
allowed local root), so the core receives ``{"type": "image", "image": bytes}`` parts; ``http(s)``
URLs pass through as ``image_url`` parts for the router's fetcher.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from epd.engine.sampling_params import SamplingParams
from epd.multimodal.media import MediaError, load_media_bytes
from epd.protocol import logprobs_to_proto
from epd.router.types import ChatRequest, RouterCore, RouterError, StreamEvent
from epd.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger("epd.router.grpc")

_REMOTE_URL_PREFIXES = ("http://", "https://")
# RouterError.status (HTTP) -> gRPC status; other 4xx are INVALID_ARGUMENT, anything else INTERNAL.
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED: seconds, as a decimal


class RouterGrpcServicer(router_pb2_grpc.RouterServicer):
    """A grpc.aio servicer. The server that hosts it should raise the message size limits
    (``epd.serving.GRPC_OPTIONS``): requests carry encoded images."""

    def __init__(self, core: RouterCore, *, allowed_local_media_path: str | None = None,
                 default_max_tokens: int = SamplingParams().max_tokens) -> None:
        self.core = core
        self.allowed_local_media_path = allowed_local_media_path
        self.default_max_tokens = default_max_tokens

    async def Generate(self, request: router_pb2.ChatGenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            chat = self._chat_request(request, request_id, context.time_remaining())
        except (MediaError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id}: {exc}")
        error, events = None, None
        try:
            events = self.core.generate(chat)
            async for response in _responses(events, request_id, chat.stop_strings):
                yield response
        except RouterError as exc:
            error = exc
        except Exception as exc:  # a bug in the core: the client gets INTERNAL, the log the trace
            log.exception("request %s failed in the router core", request_id)
            error = RouterError(500, f"internal error: {type(exc).__name__}: {exc}", error_type="internal_error")
        finally:
            # Early stop, client cancellation (CancelledError/GeneratorExit here) or a failure:
            # closing the core's iterator cancels the request on every tier.
            await _aclose(events)
        if error is not None:
            await _abort(context, error, request_id)

    async def Models(self, request, context) -> router_pb2.ModelsResponse:
        return router_pb2.ModelsResponse(models=[router_pb2.ModelCard(id=self.core.model_name)])

    async def Health(self, request, context) -> router_pb2.RouterHealthResponse:
        report = self.core.health()
        workers = [_worker_health(tier, worker)
                   for tier, tier_workers in report.get("workers", {}).items() for worker in tier_workers]
        return router_pb2.RouterHealthResponse(status=report.get("status", ""), model=self.core.model_name,
                                               workers=workers)

    # ---- proto -> ChatRequest -------------------------------------------------------------------
    def _chat_request(self, request: router_pb2.ChatGenerateRequest, request_id: str,
                      time_remaining_s: float | None) -> ChatRequest:
        if not request.messages:
            raise ValueError("expected at least one message, got none")
        messages = [self._message(i, m) for i, m in enumerate(request.messages)]
        # The call deadline bounds the request too, so the core stops when the client gives up.
        timeouts_s = [t for t in (request.timeout_s, time_remaining_s) if t and t > 0]
        return ChatRequest(messages=messages, sampling=self._sampling(request), request_id=request_id,
                           stop_strings=[s for s in request.stop if s],
                           timeout_s=min(timeouts_s) if timeouts_s else None)

    def _message(self, index: int, message: router_pb2.ChatMessage) -> dict:
        if not message.role:
            raise ValueError(f"messages[{index}] has no role; expected 'system', 'user' or 'assistant'")
        parts = [self._part(f"messages[{index}].content[{j}]", p) for j, p in enumerate(message.content)]
        if all(p["type"] == "text" for p in parts):
            return {"role": message.role, "content": "".join(p["text"] for p in parts)}
        return {"role": message.role, "content": parts}

    def _part(self, where: str, part: router_pb2.ContentPart) -> dict:
        kind = part.WhichOneof("part")
        if kind == "text":
            return {"type": "text", "text": part.text}
        if kind == "image_url" and part.image_url.startswith(_REMOTE_URL_PREFIXES):
            return {"type": "image_url", "image_url": {"url": part.image_url}}
        if kind not in ("image_bytes", "image_url"):
            raise ValueError(f"{where} is empty; expected text, image_bytes or image_url")
        source = part.image_bytes if kind == "image_bytes" else part.image_url
        try:
            data = load_media_bytes(source, allowed_local_root=self.allowed_local_media_path)
        except MediaError as exc:
            raise MediaError(f"{where}: {exc}") from exc
        return {"type": "image", "image": data}

    def _sampling(self, request: router_pb2.ChatGenerateRequest) -> SamplingParams:
        # proto3 zeros are "unset": map them to the defaults documented in router.proto.
        msg = request.sampling
        return SamplingParams(
            max_tokens=msg.max_tokens or self.default_max_tokens, min_tokens=msg.min_tokens,
            temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k or -1,
            seed=msg.seed if msg.HasField("seed") else None, stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos, logprobs=msg.logprobs if msg.HasField("logprobs") else None)


def add_router_grpc(server: grpc.aio.Server, core: RouterCore, *, allowed_local_media_path: str | None = None,
                    default_max_tokens: int = SamplingParams().max_tokens) -> RouterGrpcServicer:
    """Register the public Router service on a grpc.aio server (not started here)."""
    servicer = RouterGrpcServicer(core, allowed_local_media_path=allowed_local_media_path,
                                  default_max_tokens=default_max_tokens)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    return servicer


# ---- StreamEvent -> proto -----------------------------------------------------------------------
async def _responses(events: AsyncIterator[StreamEvent], request_id: str,
                     stop_strings: list[str]) -> AsyncIterator[router_pb2.ChatGenerateResponse]:
    stops = StopStringMatcher(stop_strings)
    async for event in events:
        text, is_stopped = stops.add(event.text, is_last=event.finish_reason is not None)
        yield router_pb2.ChatGenerateResponse(
            request_id=request_id, token_ids=event.token_ids, text=text,
            logprobs=[logprobs_to_proto(lp) for lp in event.logprobs],
            finish_reason="stop" if is_stopped else (event.finish_reason or ""),
            prompt_token_ids=event.prompt_token_ids or [], num_cached_tokens=event.num_cached_tokens)
        if is_stopped:
            return  # the caller closes the core's iterator, which cancels the rest of the request
    # A stream that ended without a final event still owes the text held back for stop strings.
    if stops.pending:
        yield router_pb2.ChatGenerateResponse(request_id=request_id, text=stops.pending)


class StopStringMatcher:
    """Applies stop strings to streamed text: output ends just before the first match, which may
    span several deltas. Text that could be the start of a stop string is held back until the
    next delta decides it (tokens are never held back)."""

    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.pending = ""

    def add(self, text: str, *, is_last: bool) -> tuple[str, bool]:
        """-> (text to emit now, whether a stop string matched)."""
        self.pending += text
        if not self.stop_strings:
            out, self.pending = self.pending, ""
            return out, False
        matches = [i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0]
        if matches:
            out, self.pending = self.pending[:min(matches)], ""
            return out, True
        keep = 0 if is_last else self._partial_match_chars()
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def _partial_match_chars(self) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest


# ---- errors -------------------------------------------------------------------------------------
async def _abort(context: grpc.aio.ServicerContext, error: RouterError, request_id: str) -> None:
    fallback = grpc.StatusCode.INVALID_ARGUMENT if 400 <= error.status < 500 else grpc.StatusCode.INTERNAL
    code = _STATUS_CODES.get(error.status, fallback)
    trailing = ()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s is not None:
        trailing = ((RETRY_AFTER_KEY, format(error.retry_after_s, "g")),)
    await context.abort(code, f"request {request_id}: {error.message}", trailing_metadata=trailing)


async def _aclose(events: AsyncIterator | None) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # closing must never mask the request's own outcome
        log.debug("closing the core's stream raised", exc_info=True)


def _worker_health(tier: str, worker: dict) -> router_pb2.WorkerHealth:
    details = {k: str(v) for k, v in worker.items() if k not in ("address", "healthy")}
    return router_pb2.WorkerHealth(tier=tier, address=str(worker.get("address", "")),
                                   healthy=bool(worker.get("healthy", False)), details=details)
