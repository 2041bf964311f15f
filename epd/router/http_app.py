"""The OpenAI-compatible HTTP front end: translates HTTP <-> ``ChatRequest``/``StreamEvent`` and
delegates everything else (media, preprocessing, stop strings, detokenization) to the ``RouterCore``.

A request's HTTP status is decided by its first event: admission failures (400 never fits, 429
saturated, 503 no workers) come before it and are answered as real error statuses, also when
streaming; failures after it end a stream with an OpenAI error event. The core's stream is read
by a task of its own (``_CorePump``), so that stopping early - the client went away, a stop
string matched - cancels the core exactly once, at the await it is blocked in, and its cleanup
(cancelling the request on every tier) can still await.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from epd.errors import (
    EPDError,
    ErrorCode,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthenticated,
    UpstreamError,
)
from epd.router.api import RouterCore
from epd.router.auth import ApiKeys
from epd.router.body_limits import BodyLimits, check_json_messages
from epd.router.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseFunction,
    ResponseMessage,
    ResponseToolCall,
    StreamChoice,
    TokenLogprob,
    Usage,
    logprobs_content,
    parse_chat_body,
    request_id_base,
    to_chat_request,
)
from epd.router.rate_limit import KeyRateLimiter
from epd.types import ChatRequest, StreamEvent, ToolCall

log = logging.getLogger("epd.router.http")

_DISCONNECT_POLL_S = 0.1  # how often a request waiting for tokens checks that its client is still there
_LINGER_S = 5.0  # a core stream still running this long after its finish event is cancelled
_STATUS_CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it
_pumps: set[asyncio.Task] = set()  # strong references: pumps may outlive their HTTP response briefly


class _ClientGone(Exception):
    pass


def build_app(core: RouterCore, *, default_max_tokens: int | None = None, tokenizer=None,
              api_keys: ApiKeys | None = None,
              protect_health_and_metrics: bool = False, limits: BodyLimits = BodyLimits(),
              rate_limiter: KeyRateLimiter | None = None, allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The HTTP app over ``core``. ``tokenizer`` (anything with ``decode(list[int])``) spells the
    tokens in logprobs; without it they are their ids as strings. ``api_keys``: what ``/v1/...``
    (and with ``protect_health_and_metrics`` also ``/health`` and ``/metrics``) requires."""
    if default_max_tokens is not None and default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be None or >= 1, got {default_max_tokens}")
    chat = _ChatCompletions(core, _TokenText(tokenizer), default_max_tokens, limits)
    created = int(time.time())
    app = FastAPI(title="EPD", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:  # browsers calling from these origins (--allowed-origins); none: no CORS headers at all
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    if api_keys is not None and api_keys.enabled:
        guarded = ("/v1/", "/tokenize", "/detokenize") + (("/health", "/metrics") if protect_health_and_metrics else ())

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            # a CORS preflight carries no credentials by design: the CORS layer answers it
            if request.url.path.startswith(guarded) and not (allowed_origins and request.method == "OPTIONS"):
                try:
                    key_id = api_keys.check_bearer(request.headers.get("authorization"))
                except Unauthenticated as err:
                    response = error_response(err)
                    response.headers["WWW-Authenticate"] = "Bearer"
                    return response
                if rate_limiter is not None and request.url.path in ("/v1/chat/completions", "/v1/completions"):
                    try:
                        rate_limiter.admit(key_id)
                    except Overloaded as err:
                        return error_response(err)
            return await call_next(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.handle(request)

    from epd.router import http_completions
    text = http_completions.TextCompletions(core, chat.token_text, limits, _CorePump, _read_json, served_name,
                                            error_response, _sse)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await text.handle(request)

    async def _tokenize(request: Request) -> Response:
        try:
            body = await _read_json(request, limits.max_body_bytes)
            served_name(core, body.get("model") if isinstance(body, dict) else None)
            return JSONResponse(await http_completions.tokenize(core, body, chat.token_text))
        except EPDError as err:
            return error_response(err)

    async def _detokenize(request: Request) -> Response:
        try:
            body = await _read_json(request, limits.max_body_bytes)
            served_name(core, body.get("model") if isinstance(body, dict) else None)
            return JSONResponse(http_completions.detokenize(core, body))
        except EPDError as err:
            return error_response(err)

    for path in ("/tokenize", "/v1/tokenize"):  # vLLM serves the first; some clients ask the second
        app.post(path)(_tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        app.post(path)(_detokenize)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse(http_completions.version())

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=name, created=created) for name in core.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        try:
            return JSONResponse(ModelCard(id=served_name(core, model_id), created=created).model_dump())
        except NotFound as err:
            return error_response(err)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            report = await _maybe_await(core.health())
        except Exception as exc:  # a health probe must answer, not crash
            log.exception("health check failed")
            return JSONResponse({"status": "error", "error": f"{type(exc).__name__}: {exc}"}, status_code=503)
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await _maybe_await(core.metrics_text()), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:  # unknown route, wrong method
        code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.INVALID_ARGUMENT
        body = ErrorResponse.of(exc.status_code, str(exc.detail), code.openai_type)
        return JSONResponse(body.model_dump(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> Response:
        log.error("unhandled error in the HTTP app", exc_info=exc)
        return error_response(InternalError("internal server error"))

    return app


def served_name(core: RouterCore, model: str | None) -> str:
    """The served name a request asked for (none: the first); any other name is a 404, as vLLM's."""
    if model is None:
        return core.model_name
    if model not in core.served_model_names:
        served = ", ".join(repr(name) for name in core.served_model_names)
        raise NotFound(f"the model {model!r} does not exist; this server serves {served}", param="model")
    return model


def error_response(err: EPDError) -> JSONResponse:
    """An ``EPDError`` as OpenAI sends errors; 429 carries Retry-After in whole seconds."""
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(0, math.ceil(err.retry_after_s)))
    return JSONResponse(ErrorResponse.of_error(err).model_dump(), status_code=err.http_status, headers=headers)


class _ChatCompletions:
    def __init__(self, core: RouterCore, token_text: Callable[[int], str], default_max_tokens: int | None,
                 limits: BodyLimits) -> None:
        self.core, self.token_text = core, token_text
        self.default_max_tokens, self.limits = default_max_tokens, limits

    async def handle(self, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        pump: _CorePump | None = None
        try:
            raw = await _read_json(request, self.limits.max_body_bytes)
            check_json_messages(raw.get("messages") if isinstance(raw, dict) else None, self.limits)
            body = parse_chat_body(raw)
            client_id = request_id_base(request.headers.get("x-request-id"), body)
            request_id = f"chatcmpl-{client_id or uuid.uuid4().hex}"
            model = served_name(self.core, body.model)
            chat = to_chat_request(body, request_id, default_max_tokens=self.default_max_tokens)
            pump = _CorePump(self.core, chat)
            first = await pump.next(request)
            if first is None:
                raise UpstreamError("the router's stream ended before any output")
            out = _Completion(request_id, model, body, chat, self.token_text)
            out.header_id = client_id or request_id  # the client's own id comes back as it was sent
            if body.stream:
                stream, pump = self._stream(request, pump, first, out), None  # the stream owns the pump now
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": out.header_id})
            return await self._complete(request, pump, first, out)
        except EPDError as err:
            return error_response(err)
        except _ClientGone:
            return Response(status_code=_STATUS_CLIENT_GONE)
        except Exception:
            log.exception("request %s failed", request_id)
            return error_response(InternalError(f"internal server error (request {request_id})"))
        finally:
            if pump is not None:
                pump.close()

    async def _complete(self, request: Request, pump: _CorePump, event: StreamEvent, out: _Completion) -> Response:
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

    async def _stream(self, request: Request, pump: _CorePump, event: StreamEvent | None,
                      out: _Completion) -> AsyncIterator[bytes]:
        cancel = True  # unless the core's stream ends on its own
        try:
            prompt_token_ids = list(event.prompt_token_ids or []) if out.return_token_ids else None
            for choice in out.choices:  # each choice opens with its role, as OpenAI's streams do
                yield _sse(out.chunk(choice, DeltaMessage(role="assistant", content=""),
                                     prompt_token_ids=prompt_token_ids if choice.index == 0 else None))
            while event is not None:
                choice, text, token_ids, logprobs = out.add(event)
                if text or (token_ids and (out.return_token_ids or logprobs is not None)):
                    yield _sse(out.chunk(choice, DeltaMessage(content=text), token_ids=token_ids, logprobs=logprobs))
                if event.tool_calls:
                    yield _sse(out.chunk(choice, DeltaMessage(tool_calls=choice.delta_calls(event.tool_calls))))
                if choice.finish_reason:
                    yield _sse(out.chunk(choice, DeltaMessage(), finish_reason=choice.finish_reason,
                                         stop_reason=choice.stop_reason))
                if out.is_finished:
                    break
                event = await pump.next(None)  # Starlette cancels this stream when the client leaves
            for choice in out.finish_unfinished():  # the core's stream ended with no finish reason
                yield _sse(out.chunk(choice, DeltaMessage(), finish_reason=choice.finish_reason))
            cancel = False
            if out.include_usage:
                yield _sse(ChatCompletionChunk(id=out.request_id, created=out.created, model=out.model, choices=[],
                                               usage=out.usage()))
            yield b"data: [DONE]\n\n"
        except _ClientGone:
            log.info("request %s: client went away; cancelling", out.request_id)
        except EPDError as err:
            yield _sse(ErrorResponse.of_error(err))
            yield b"data: [DONE]\n\n"
        except Exception:
            log.exception("request %s failed mid-stream", out.request_id)
            yield _sse(ErrorResponse.of_error(InternalError(f"internal server error (request {out.request_id})")))
            yield b"data: [DONE]\n\n"
        finally:  # also on the client leaving: the ASGI server cancels or closes this generator
            pump.close(cancel=cancel)


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


class _CorePump:
    """Reads ``core.generate(request)`` in a task of its own and queues the events (then None at
    the end, or the exception that ended it)."""

    def __init__(self, core: RouterCore, request: ChatRequest) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._task = asyncio.create_task(self._run(core, request), name=f"core-stream-{request.request_id}")
        _pumps.add(self._task)
        self._task.add_done_callback(_pumps.discard)

    async def _run(self, core: RouterCore, request: ChatRequest) -> None:
        events = None
        try:
            events = core.generate(request)
            async for event in events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(None)
        except Exception as exc:  # an EPDError or a bug: the reader raises it
            self._queue.put_nowait(exc)
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:  # the contract's "close the iterator"; a no-op once it has ended
                await aclose()

    async def next(self, request: Request | None) -> StreamEvent | None:
        """The next event, None at the end; raises what the core raised, or ``_ClientGone``.
        ``request``: watch that client while waiting (a streaming response needs not: Starlette
        cancels it when its client leaves). Asking is not free (~50 us), so never per token."""
        if not self._queue.empty():  # tokens arrive faster than they are sent: no waiting needed
            return self._unwrap(self._queue.get_nowait())
        if request is None:
            return self._unwrap(await self._queue.get())
        if await request.is_disconnected():
            raise _ClientGone()
        getter = asyncio.ensure_future(self._queue.get())
        try:
            while not getter.done():
                await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if not getter.done() and await request.is_disconnected():
                    raise _ClientGone()
        finally:
            getter.cancel()
        return self._unwrap(getter.result())

    @staticmethod
    def _unwrap(item: StreamEvent | BaseException | None) -> StreamEvent | None:
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, *, cancel: bool = True) -> None:
        """Stop reading. ``cancel``: the request is abandoned, so the core's stream is cancelled
        now; otherwise it finished and gets ``_LINGER_S`` to wind down on its own. Idempotent."""
        if self._closed or self._task.done():
            return
        self._closed = True
        if cancel:
            self._task.cancel()
        else:
            asyncio.get_running_loop().call_later(_LINGER_S, self._task.cancel)


class _TokenText:
    """token id -> its text for logprobs, cached (the same tokens recur across requests)."""

    _MAX_CACHED = 1 << 16

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = str(token_id) if self.tokenizer is None else self.tokenizer.decode([token_id])
            if len(self._cache) < self._MAX_CACHED:
                self._cache[token_id] = text
        return text


async def _read_json(request: Request, max_bytes: int):
    """The body as JSON; a body over ``max_bytes`` is refused by its Content-Length, or as soon as
    that many bytes arrived, never read whole."""
    too_large = PayloadTooLarge(f"the request body is larger than {max_bytes} bytes (max_request_body_bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # [[[[...: the parser gives up before the body ends
        raise InvalidRequest("the request body nests JSON arrays or objects too deeply to parse") from None


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _sse(model) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"
