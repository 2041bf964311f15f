"""The router's public gRPC face (``proto/epd/v1/router.proto``): translates proto <-> ChatRequest /
StreamEvent over a RouterCore and delegates; an ``EPDError`` becomes its gRPC status.

Image parts pass through as they came (bytes, or a URL of any scheme): the router's pipeline
resolves them, the same way for this API as for HTTP.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from epd.errors import EPDError, InvalidRequest, Overloaded, Unauthenticated, as_epd_error
from epd.models.generation_config import OPENAI_DEFAULTS, GenerationDefaults
from epd.router.api import RouterCore
from epd.router.auth import ApiKeys
from epd.router.body_limits import BodyLimits, check_counts
from epd.router.rate_limit import KeyRateLimiter
from epd.router.request_rule import chat_request
from epd.router.tool_calls import arguments_for_template
from epd.types import MAX_TOKENS_TO_FILL, ChatRequest, SamplingParams, StreamEvent
from epd.v1 import router_pb2, router_pb2_grpc
from epd.wire.protocol import logits_processors_from_proto, logprobs_to_proto
from epd.wire.rpc import MAX_MESSAGE_BYTES, SERVER_OPTIONS, abort_with_async

log = logging.getLogger("epd.router.grpc")


class RouterGrpcServicer(router_pb2_grpc.RouterServicer):
    """A grpc.aio servicer. The server that hosts it should raise the message size limits
    (``epd.wire.rpc.SERVER_OPTIONS``): requests carry encoded images."""

    def __init__(self, core: RouterCore, *, default_max_tokens: int | None = None, limits: BodyLimits = BodyLimits(),
                 generation: GenerationDefaults = OPENAI_DEFAULTS) -> None:
        self.core = core
        self.default_max_tokens = default_max_tokens
        self.generation = generation  # what unset sampling fields become, as over HTTP
        self.limits = limits  # the message size itself is the server's max_receive_message_length

    async def Generate(self, request: router_pb2.ChatGenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            chat = self._chat_request(request, request_id, context.time_remaining())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id}: {exc}")
        error, events = None, None
        try:
            events = self.core.generate(chat)
            async for event in events:
                yield _response(event, request_id)
        except EPDError as exc:
            error = exc
        except Exception as exc:  # a bug in the core: the client gets INTERNAL, the log the trace
            log.exception("request %s failed in the router core", request_id)
            error = as_epd_error(exc)
        finally:
            # Early stop, client cancellation (CancelledError/GeneratorExit here) or a failure:
            # closing the core's iterator cancels the request on every tier.
            await _aclose(events)
        if error is not None:
            await _abort(context, error, request_id)

    async def Models(self, request, context) -> router_pb2.ModelsResponse:
        cards = [router_pb2.ModelCard(id=name) for name in self.core.served_model_names]
        return router_pb2.ModelsResponse(models=cards)

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
        check_counts(self.limits, num_messages=len(request.messages),
                     num_parts=sum(len(m.content) for m in request.messages),
                     num_chars=sum(len(p.text) for m in request.messages for p in m.content))
        messages = [self._message(i, m) for i, m in enumerate(request.messages)]
        # The call deadline bounds the request too, so the core stops when the client gives up.
        timeouts_s = [t for t in (request.timeout_s, time_remaining_s) if t and t > 0]
        return chat_request(messages=messages, sampling=self._sampling(request), request_id=request_id,
                            structured_param="sampling.structured", n=request.n or None, tools=_json_field(request.tools_json, "tools_json"),
                            tool_choice=_json_field(request.tool_choice_json, "tool_choice_json"),
                            parallel_tool_calls=request.parallel_tool_calls if request.HasField(
                                "parallel_tool_calls") else None,
                            stop_strings=[s for s in request.stop if s],
                            timeout_s=min(timeouts_s) if timeouts_s else None,
                            include_stop_str_in_output=request.include_stop_str_in_output,
                            fill_max_tokens=not request.sampling.max_tokens and self.default_max_tokens is None
                            and self.generation.max_tokens is None,
                            mm_processor_kwargs=dict(request.mm_processor_kwargs) or None)

    def _message(self, index: int, message: router_pb2.ChatMessage) -> dict:
        if not message.role:
            raise ValueError(f"messages[{index}] has no role; expected 'system', 'user' or 'assistant'")
        parts = [self._part(f"messages[{index}].content[{j}]", p) for j, p in enumerate(message.content)]
        if all(p["type"] == "text" for p in parts):
            out = {"role": message.role, "content": "".join(p["text"] for p in parts)}
        else:
            out = {"role": message.role, "content": parts}
        if message.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": arguments_for_template(c.arguments)}}
                                 for c in message.tool_calls]
        if message.tool_call_id:
            out["tool_call_id"] = message.tool_call_id
        return out

    @staticmethod
    def _part(where: str, part: router_pb2.ContentPart) -> dict:
        kind = part.WhichOneof("part")
        if kind == "text":
            return {"type": "text", "text": part.text}
        if kind == "image_url":
            return {"type": "image_url", "image_url": {"url": part.image_url}}
        if kind == "image_bytes":
            return {"type": "image", "image": part.image_bytes}
        if kind == "video_url":
            return {"type": "video_url", "video_url": {"url": part.video_url}}
        if kind == "video_bytes":
            return {"type": "video", "video": part.video_bytes}
        raise InvalidRequest(f"{where} is empty; expected text, image_bytes or image_url")

    def _sampling(self, request: router_pb2.ChatGenerateRequest) -> SamplingParams:
        # proto3 zeros are "unset": map them to the defaults documented in router.proto.
        msg, defaults = request.sampling, self.generation
        processors = logits_processors_from_proto(msg)
        if not msg.HasField("repetition_penalty"):
            processors["repetition_penalty"] = defaults.repetition_penalty
        processors["min_p"] = msg.min_p or defaults.min_p
        return SamplingParams(
            max_tokens=msg.max_tokens or self.default_max_tokens or defaults.max_tokens or MAX_TOKENS_TO_FILL,
            min_tokens=msg.min_tokens,
            temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
            top_p=msg.top_p or defaults.top_p, top_k=msg.top_k or defaults.top_k,
            seed=msg.seed if msg.HasField("seed") else None, stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos, logprobs=msg.logprobs if msg.HasField("logprobs") else None, **processors)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The public API's calls need ``authorization: Bearer <key>`` metadata (``ApiKeys``); Health
    stays open unless ``protect_health``. A refused call ends UNAUTHENTICATED before its handler."""

    def __init__(self, api_keys: ApiKeys, *, protect_health: bool = False,
                 rate_limiter: KeyRateLimiter | None = None) -> None:
        self.api_keys, self.protect_health, self.rate_limiter = api_keys, protect_health, rate_limiter

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or (details.method.endswith("/Health") and not self.protect_health):
            return handler
        metadata = dict(details.invocation_metadata or ())
        try:
            key_id = self.api_keys.check_bearer(metadata.get("authorization"))
            if self.rate_limiter is not None and details.method.endswith("/Generate"):
                self.rate_limiter.admit(key_id)
        except (Unauthenticated, Overloaded) as err:
            return _refusing(handler, err)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, err: EPDError) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that only aborts with ``err``'s status (and retry hint)."""
    async def refuse(request, context):
        await abort_with_async(context, err)

    async def refuse_stream(request, context):
        await abort_with_async(context, err)
        yield  # unreachable: makes this an async generator, as a streaming handler must be

    serde = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serde)
    return grpc.unary_unary_rpc_method_handler(refuse, **serde)


def public_server_options(limits: BodyLimits) -> list[tuple]:
    """The public gRPC server's options: a message over the body limit is refused by gRPC itself
    (RESOURCE_EXHAUSTED) before it is read."""
    return [*(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", min(limits.max_body_bytes, MAX_MESSAGE_BYTES))]


def add_router_grpc(server: grpc.aio.Server, core: RouterCore, *, default_max_tokens: int | None = None,
                    limits: BodyLimits = BodyLimits(),
                    generation: GenerationDefaults = OPENAI_DEFAULTS) -> RouterGrpcServicer:
    """Register the public Router service on a grpc.aio server (not started here)."""
    servicer = RouterGrpcServicer(core, default_max_tokens=default_max_tokens, limits=limits, generation=generation)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    return servicer


# ---- StreamEvent -> proto -----------------------------------------------------------------------
def _response(event: StreamEvent, request_id: str) -> router_pb2.ChatGenerateResponse:
    msg = router_pb2.ChatGenerateResponse(
        request_id=request_id, token_ids=event.token_ids, text=event.text,
        logprobs=[logprobs_to_proto(lp) for lp in event.logprobs], finish_reason=event.finish_reason or "",
        prompt_token_ids=event.prompt_token_ids or [], num_cached_tokens=event.num_cached_tokens, index=event.index)
    msg.tool_calls.extend(router_pb2.ChatToolCall(id=c.id, name=c.name, arguments=c.arguments)
                          for c in event.tool_calls)
    if isinstance(event.stop_reason, str):
        msg.stop_string = event.stop_reason
    elif event.stop_reason is not None:
        msg.stop_token_id = event.stop_reason
    return msg


def _json_field(text: str, name: str):
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as err:
        raise InvalidRequest(f"{name} is not valid JSON: {err}", param=name) from None


# ---- errors -------------------------------------------------------------------------------------
async def _abort(context: grpc.aio.ServicerContext, error: EPDError, request_id: str) -> None:
    await abort_with_async(context, error, f"request {request_id}: {error.message}")


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
