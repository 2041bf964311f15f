"""``/v1/chat/completions``: a body becomes a ``ChatRequest`` (``requests``), the core's events
become one response or a stream of chunks (``responses``).

A request's HTTP status is decided by its first event: admission failures (400 never fits, 429
saturated, 503 no workers) come before it and are answered as real error statuses, also when
streaming; failures after it end a stream with an OpenAI error event.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from epd.errors import EPDError, InternalError, UpstreamError
from epd.models.generation_config import OPENAI_DEFAULTS, GenerationDefaults
from epd.router.api import RouterCore
from epd.router.body_limits import BodyLimits, check_json_messages
from epd.router.openai.requests import (
    ChatCompletionRequest,
    parse_chat_body,
    read_json,
    request_id_base,
    served_name,
    to_chat_request,
)
from epd.router.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    ChunkHead,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunction,
    ResponseMessage,
    ResponseToolCall,
    StreamChoice,
    TokenLogprob,
    Usage,
    error_response,
    logprobs_content,
    usage_json,
)
from epd.router.openai.streaming import DONE, STATUS_CLIENT_GONE, ClientGone, CorePump, EventStream, failure_frames, sse
from epd.types import ChatRequest, StreamEvent, ToolCall

log = logging.getLogger("epd.router.http")


class ChatCompletions:
    def __init__(self, core: RouterCore, token_text: Callable[[int], str], default_max_tokens: int | None,
                 limits: BodyLimits, defaults: GenerationDefaults = OPENAI_DEFAULTS) -> None:
        self.core, self.token_text = core, token_text
        self.default_max_tokens, self.limits, self.defaults = default_max_tokens, limits, defaults

    async def handle(self, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        pump: CorePump | None = None
        try:
            raw = await read_json(request, self.limits.max_body_bytes)
            check_json_messages(raw.get("messages") if isinstance(raw, dict) else None, self.limits)
            body = parse_chat_body(raw)
            client_id = request_id_base(request.headers.get("x-request-id"), body)
            request_id = f"chatcmpl-{client_id or uuid.uuid4().hex}"
            model = served_name(self.core, body.model)
            chat = to_chat_request(body, request_id, default_max_tokens=self.default_max_tokens,
                                   defaults=self.defaults)
            pump = CorePump(self.core, chat, stream=body.stream)
            first = await pump.next(request)
            if first is None:
                raise UpstreamError("the router's stream ended before any output")
            out = _Completion(request_id, model, body, chat, self.token_text)
            out.header_id = client_id or request_id  # the client's own id comes back as it was sent
            if body.stream:
                stream, pump = EventStream(pump, _ChatFrames(out), {"X-Request-Id": out.header_id}), None
                return stream  # the stream owns the pump now
            return await self._complete(request, pump, first, out)
        except EPDError as err:
            return error_response(err)
        except ClientGone:
            return Response(status_code=STATUS_CLIENT_GONE)
        except Exception:
            log.exception("request %s failed", request_id)
            return error_response(InternalError(f"internal server error (request {request_id})"))
        finally:
            if pump is not None:
                pump.close()

    async def _complete(self, request: Request, pump: CorePump, event: StreamEvent, out: _Completion) -> Response:
        while True:
            out.add(event)
            if out.is_finished:
                break
            event = await pump.next(request)
            if event is None:  # the core's stream ended with no finish reason
                out.finish_unfinished()
                break
        pump.close(cancel=False)
        response = ChatCompletionResponse(
            id=out.request_id, created=out.created, model=out.model, usage=out.usage(),
            prompt_token_ids=out.prompt_token_ids if out.return_token_ids else None,
            choices=[Choice(index=c.index, message=_message("".join(c.texts), c.calls), finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            logprobs=ChoiceLogprobs(content=c.logprobs) if out.num_logprobs is not None else None,
                            token_ids=c.token_ids if out.return_token_ids else None) for c in out.choices])
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": out.header_id})


class _ChatFrames:
    """A chat stream's frames (``streaming.Frames``): each choice opens with its role, as OpenAI's
    streams do; then text deltas (written as bytes), tool calls, each choice's finish, usage when
    asked, and [DONE]."""

    def __init__(self, out: _Completion) -> None:
        self.out = out
        self.head = ChunkHead(out.request_id, "chat.completion.chunk", out.created, out.model)

    @property
    def is_finished(self) -> bool:
        return self.out.is_finished

    def opening(self, first: StreamEvent) -> bytes:
        out = self.out
        prompt_token_ids = list(first.prompt_token_ids or []) if out.return_token_ids else None
        return b"".join(sse(out.chunk(choice, DeltaMessage(role="assistant", content=""),
                                      prompt_token_ids=prompt_token_ids if choice.index == 0 else None))
                        for choice in out.choices)

    def event(self, event: StreamEvent) -> bytes:
        out = self.out
        choice, text, token_ids, logprobs = out.add(event)
        frames = []
        if logprobs is not None and (text or token_ids):
            frames.append(sse(out.chunk(choice, DeltaMessage(content=text), token_ids=token_ids, logprobs=logprobs)))
        elif text or (token_ids and out.return_token_ids):
            frames.append(self.head.chat_text(choice.index, text, token_ids if out.return_token_ids else None,
                                              out.usage_json() if out.continuous_usage else None))
        if event.tool_calls:
            frames.append(sse(out.chunk(choice, DeltaMessage(tool_calls=choice.delta_calls(event.tool_calls)))))
        if choice.finish_reason:
            frames.append(sse(out.chunk(choice, DeltaMessage(), finish_reason=choice.finish_reason,
                                        stop_reason=choice.stop_reason)))
        return b"".join(frames)

    def end(self) -> bytes:
        out = self.out
        frames = [sse(out.chunk(choice, DeltaMessage(), finish_reason=choice.finish_reason))
                  for choice in out.finish_unfinished()]  # the core's stream ended with no finish reason
        if out.include_usage:
            frames.append(sse(ChatCompletionChunk(id=out.request_id, created=out.created, model=out.model, choices=[],
                                                  usage=out.usage())))
        return b"".join(frames) + DONE

    def fail(self, exc: BaseException) -> bytes:
        return failure_frames(exc, self.out.request_id)


class _ChoiceState:
    """One choice's output as it accumulates."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.calls: list[ToolCall] = []
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def delta_calls(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        """Calls as stream deltas, each whole in one (OpenAI's clients join a call's pieces by index)."""
        out = [DeltaToolCall(index=len(self.calls) - len(calls) + k, id=call.id,
                             function=DeltaFunction(name=call.name, arguments=call.arguments))
               for k, call in enumerate(calls)]
        return out


class _Completion:
    """One request's output as it accumulates: the prompt's counts, and each choice's pieces that go
    into chunks or the final response."""

    def __init__(self, request_id: str, model: str, body: ChatCompletionRequest, chat: ChatRequest,
                 token_text: Callable[[int], str]) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.header_id = request_id
        self.return_token_ids, self.include_usage = bool(body.return_token_ids), body.include_usage
        self.continuous_usage = body.continuous_usage
        self.num_logprobs = chat.sampling.logprobs
        self.token_text = token_text
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.choices = [_ChoiceState(i) for i in range(chat.n)]

    def add(self, event: StreamEvent) -> tuple[_ChoiceState, str, list[int], list[TokenLogprob] | None]:
        """(its choice, text to send, token ids, logprobs entries or None when not asked for)."""
        choice = self.choices[event.index]
        if event.prompt_token_ids is not None and event.index == 0:
            self.prompt_token_ids = list(event.prompt_token_ids)
            self.num_cached_tokens = event.num_cached_tokens
        choice.num_completion_tokens += len(event.token_ids)
        choice.finish_reason = event.finish_reason or choice.finish_reason
        choice.stop_reason = event.stop_reason if event.stop_reason is not None else choice.stop_reason
        choice.calls += event.tool_calls
        choice.texts.append(event.text)
        choice.token_ids += event.token_ids
        logprobs = (logprobs_content(event.logprobs, self.token_text, self.num_logprobs)
                    if self.num_logprobs is not None else None)
        choice.logprobs += logprobs or []
        return choice, event.text, list(event.token_ids), logprobs

    @property
    def is_finished(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def finish_unfinished(self) -> list[_ChoiceState]:
        """The choices the core's stream left without a finish reason: they end with "stop"."""
        left = [c for c in self.choices if not c.finish_reason]
        for choice in left:
            choice.finish_reason = "stop"
        return left

    def usage(self) -> Usage:
        return Usage.of(len(self.prompt_token_ids), sum(c.num_completion_tokens for c in self.choices),
                        self.num_cached_tokens)

    def usage_json(self) -> bytes:
        return usage_json(len(self.prompt_token_ids), sum(c.num_completion_tokens for c in self.choices),
                          self.num_cached_tokens)

    def chunk(self, choice: _ChoiceState, delta: DeltaMessage, *, finish_reason: str | None = None,
              token_ids: list[int] | None = None, logprobs: list[TokenLogprob] | None = None,
              prompt_token_ids: list[int] | None = None, stop_reason: str | int | None = None) -> ChatCompletionChunk:
        streamed = StreamChoice(index=choice.index, delta=delta, finish_reason=finish_reason, stop_reason=stop_reason,
                                logprobs=ChoiceLogprobs(content=logprobs) if logprobs is not None else None,
                                token_ids=token_ids if self.return_token_ids and token_ids is not None else None)
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[streamed],
                                   prompt_token_ids=prompt_token_ids,
                                   usage=self.usage() if self.continuous_usage else None)


def _message(text: str, calls: list[ToolCall]) -> ResponseMessage:
    """The answer: its text (None when it is only calls, as OpenAI sends it) and its tool calls."""
    tool_calls = [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
                  for c in calls]
    if calls:  # the text before the calls, as vLLM's Hermes parser returns it
        return ResponseMessage(content=text.strip() or None, tool_calls=tool_calls)
    return ResponseMessage(content=text, tool_calls=tool_calls)
