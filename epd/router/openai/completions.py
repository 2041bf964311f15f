"""``/v1/completions``: a raw prompt (text or token ids, no chat template), OpenAI's legacy
response shape (``text_completion``; logprobs as ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``).

Completions share the chat path's sampling, stop strings, structured output, request rule and
streaming pump; what differs is the prompt and the response shape.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError

from epd.errors import EPDError, InternalError, InvalidRequest, UpstreamError
from epd.models.generation_config import OPENAI_DEFAULTS, GenerationDefaults
from epd.router.body_limits import BodyLimits
from epd.router.openai.fields import check_chat_fields
from epd.router.openai.requests import (
    GenerationFields,
    read_json,
    request_id_base,
    sampling_params,
    served_name,
    stop_strings,
    structured_output,
    validation_error,
)
from epd.router.openai.responses import ChunkHead, Usage, error_response, usage_json
from epd.router.openai.streaming import DONE, STATUS_CLIENT_GONE, ClientGone, CorePump, EventStream, failure_frames, sse
from epd.router.request_rule import chat_request
from epd.types import ChatRequest, StreamEvent, TokenLogprobs

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


_OWN_FIELDS = {"prompt", "echo", "suffix", "logprobs", "best_of"}
# no chat template and no images here: these would change nothing, so they are refused by name
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
              "chat_template_kwargs", "mm_processor_kwargs")


def completion_request(body: Any, request_id: str,
                       defaults: GenerationDefaults = OPENAI_DEFAULTS) -> tuple[CompletionRequest, ChatRequest]:
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"expected a JSON object as the request body, got {type(body).__name__}")
    for name in _CHAT_ONLY:  # chat fields mean nothing here: a 400, not a silent drop
        if body.get(name) not in (None, [], {}):
            raise InvalidRequest(f"{name} is a chat completions field (/v1/chat/completions); /v1/completions takes "
                                 f"a prompt", param=name)
    check_chat_fields({k: v for k, v in body.items() if k not in _OWN_FIELDS})  # the same rule for the rest
    try:
        parsed = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise InvalidRequest(f"one prompt per request (a list of {len(prompt)} prompts is not supported)",
                                 param="prompt")
        prompt = prompt[0]
    for name, ok, expected in (("suffix", parsed.suffix in (None, ""), "unset (insertion is not supported)"),
                               ("n", parsed.n in (None, 1), "1 (one choice per request)"),
                               ("best_of", parsed.best_of in (None, 1), "1 (best-of is not supported)"),
                               ("logprobs", parsed.logprobs is None or 0 <= parsed.logprobs <= MAX_COMPLETION_LOGPROBS,
                                f"in [0, {MAX_COMPLETION_LOGPROBS}]"),
                               ("echo", not (parsed.echo and parsed.logprobs is not None),
                                "false with logprobs (prompt logprobs are not computed)")):
        if not ok:
            raise InvalidRequest(f"{name} must be {expected}, got {getattr(parsed, name)!r}", param=name)
    if parsed.stream_options is not None and not parsed.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    structured_param, structured = structured_output(parsed)
    default_max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if defaults.max_tokens is None else defaults.max_tokens
    chat = chat_request(messages=[], sampling=sampling_params(parsed, default_max_tokens, parsed.logprobs,
                                                              structured, defaults),
                        structured_param=structured_param, request_id=request_id, n=parsed.n,
                        stop_strings=stop_strings(parsed.stop), prompt=prompt,
                        include_stop_str_in_output=parsed.include_stop_str_in_output)
    return parsed, chat


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TextCompletions:
    def __init__(self, core, token_text: Callable[[int], str], limits: BodyLimits,
                 defaults: GenerationDefaults = OPENAI_DEFAULTS) -> None:
        self.core, self.token_text, self.limits, self.defaults = core, token_text, limits, defaults

    async def handle(self, request: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        pump = None
        try:
            raw = await read_json(request, self.limits.max_body_bytes)
            body, chat = completion_request(raw, request_id, self.defaults)
            request_id = f"cmpl-{request_id_base(request.headers.get('x-request-id'), body) or uuid.uuid4().hex}"
            chat.request_id = request_id
            model = served_name(self.core, body.model)
            pump = CorePump(self.core, chat, stream=body.stream)
            first = await pump.next(request)
            if first is None:
                raise UpstreamError("the router's stream ended before any output")
            out = _TextOutput(request_id, model, body, self.token_text, self.core.detokenize)
            if body.stream:
                stream, pump = EventStream(pump, _TextFrames(out), {}), None
                return stream  # the stream owns the pump now
            return await self._complete(request, pump, first, out)
        except EPDError as err:
            return error_response(err)
        except ClientGone:  # as for chats: nobody reads it, and it is no server error
            return Response(status_code=STATUS_CLIENT_GONE)
        except Exception:  # noqa: BLE001 - an answer, never a traceback
            return error_response(InternalError(f"internal server error (request {request_id})"))
        finally:
            if pump is not None:
                pump.close()

    async def _complete(self, request: Request, pump, event: StreamEvent, out: "_TextOutput") -> Response:
        while True:
            out.add(event)
            if out.finish_reason:
                break
            event = await pump.next(request)
            if event is None:
                out.finish_reason = "stop"
                break
        pump.close(cancel=False)
        return JSONResponse(out.response(out.text(), out.all_logprobs()).model_dump(exclude_none=True))


class _TextFrames:
    """A text completion's stream (``streaming.Frames``): the prompt first with echo, then text
    pieces (written as bytes unless they carry logprobs), a last chunk with the finish, usage when
    asked, and [DONE]."""

    def __init__(self, out: _TextOutput) -> None:
        self.out = out
        self.head = ChunkHead(out.request_id, "text_completion", out.created, out.model)

    @property
    def is_finished(self) -> bool:
        return self.out.finish_reason is not None

    def opening(self, first: StreamEvent) -> bytes:
        if not self.out.echo:
            return b""
        self.out.take_prompt(first)  # the prompt first, as its own piece
        return sse(self.out.response(self.out.prompt_text, None, usage=False))

    def event(self, event: StreamEvent) -> bytes:
        out = self.out
        piece = out.add(event)
        if piece.logprobs is not None:
            return sse(out.response(piece.text, piece.logprobs, usage=False))
        if piece.text:
            return self.head.completion_text(piece.text, out.usage_json() if out.continuous_usage else None)
        return b""

    def end(self) -> bytes:
        out = self.out
        if out.finish_reason is None:  # the core's stream ended with no finish reason
            out.finish_reason = "stop"
        frames = [sse(out.response("", None, usage=False, final=True))]
        if out.include_usage:
            frames.append(sse(CompletionResponse(id=out.request_id, created=out.created, model=out.model, choices=[],
                                                 usage=out.usage())))
        return b"".join(frames) + DONE

    def fail(self, exc: BaseException) -> bytes:
        return failure_frames(exc, self.out.request_id)


class _Piece:
    def __init__(self, text: str, logprobs: CompletionLogprobs | None) -> None:
        self.text, self.logprobs = text, logprobs


class _TextOutput:
    def __init__(self, request_id: str, model: str, body: CompletionRequest, token_text, detokenize) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.echo, self.include_usage, self.num_logprobs = body.echo, body.include_usage, body.logprobs
        self.continuous_usage = body.continuous_usage  # usage so far on every streamed chunk
        self.token_text, self.detokenize = token_text, detokenize
        self.prompt_text, self.prompt_token_ids = "", []
        self.pieces: list[str] = []
        self.logprobs = CompletionLogprobs()
        self.offset = 0
        self.num_cached_tokens = self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def take_prompt(self, event: StreamEvent) -> None:
        """The prompt's counts (and its text, with echo) from the event that carries them."""
        if event.prompt_token_ids is not None and not self.prompt_token_ids:
            self.prompt_token_ids = list(event.prompt_token_ids)
            self.num_cached_tokens = event.num_cached_tokens
            if self.echo:
                self.prompt_text = self.detokenize(self.prompt_token_ids)
                self.offset = len(self.prompt_text)

    def add(self, event: StreamEvent) -> _Piece:
        self.take_prompt(event)
        self.num_completion_tokens += len(event.token_ids)
        self.finish_reason = event.finish_reason or self.finish_reason
        self.stop_reason = event.stop_reason if event.stop_reason is not None else self.stop_reason
        self.pieces.append(event.text)
        piece = None
        if self.num_logprobs is not None:
            piece = self._logprobs(event.logprobs)
        return _Piece(event.text, piece)

    def _logprobs(self, entries: list[TokenLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries:
            text = self.token_text(entry.token_id)
            top = sorted(entry.top.items(), key=lambda kv: kv[1], reverse=True)[:self.num_logprobs]
            out.tokens.append(text)
            out.token_logprobs.append(max(entry.logprob, -9999.0))
            out.top_logprobs.append({self.token_text(t): max(lp, -9999.0) for t, lp in top})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.logprobs, name).extend(getattr(out, name))
        return out

    def text(self) -> str:
        return (self.prompt_text if self.echo else "") + "".join(self.pieces)

    def all_logprobs(self) -> CompletionLogprobs | None:
        return self.logprobs if self.num_logprobs is not None else None

    def usage(self) -> Usage:
        return Usage.of(len(self.prompt_token_ids), self.num_completion_tokens, self.num_cached_tokens)

    def usage_json(self) -> bytes:
        return usage_json(len(self.prompt_token_ids), self.num_completion_tokens, self.num_cached_tokens)

    def response(self, text: str, logprobs: CompletionLogprobs | None, *, usage: bool = True,
                 final: bool = False) -> CompletionResponse:
        done = final or usage
        choice = CompletionChoice(text=text, logprobs=logprobs,
                                  finish_reason=self.finish_reason if done else None,
                                  stop_reason=self.stop_reason if done else None)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                  usage=self.usage() if usage or self.continuous_usage else None)
