"""The OpenAI-compatible HTTP app: its routes, the API-key and CORS layers, and the errors of the
app itself (an unknown route, a bug). Each API has its module: ``chat``, ``completions``,
``tokenize``; ``requests`` and ``responses`` are the wire, ``streaming`` what a running response
needs, ``fields`` what every request field gets.
"""
from __future__ import annotations

import inspect
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from epd.errors import EPDError, ErrorCode, InternalError, NotFound, Overloaded, Unauthenticated
from epd.models.generation_config import OPENAI_DEFAULTS, GenerationDefaults
from epd.router.api import RouterCore
from epd.router.auth import ApiKeys
from epd.router.body_limits import BodyLimits
from epd.router.openai import tokenize
from epd.router.openai.chat import ChatCompletions
from epd.router.openai.completions import TextCompletions
from epd.router.openai.requests import read_json, served_name
from epd.router.openai.responses import ErrorResponse, ModelCard, ModelList, TokenText, error_response
from epd.router.rate_limit import KeyRateLimiter

log = logging.getLogger("epd.router.http")


def build_app(core: RouterCore, *, default_max_tokens: int | None = None, tokenizer=None,
              api_keys: ApiKeys | None = None,
              protect_health_and_metrics: bool = False, limits: BodyLimits = BodyLimits(),
              rate_limiter: KeyRateLimiter | None = None, allowed_origins: tuple[str, ...] = (),
              generation: GenerationDefaults = OPENAI_DEFAULTS) -> FastAPI:
    """The HTTP app over ``core``. ``tokenizer`` (anything with ``decode(list[int])``) spells the
    tokens in logprobs; without it they are their ids as strings. ``api_keys``: what ``/v1/...``
    (and with ``protect_health_and_metrics`` also ``/health`` and ``/metrics``) requires;
    ``generation``: what a request's unset sampling fields become (``epd.models.generation_config``)."""
    if default_max_tokens is not None and default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be None or >= 1, got {default_max_tokens}")
    chat = ChatCompletions(core, TokenText(tokenizer), default_max_tokens, limits, generation)
    created = int(time.time())
    app = FastAPI(title="EPD", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_origins:  # browsers calling from these origins (--allowed-origins); none: no CORS headers at all
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    if api_keys is not None and api_keys.enabled:
        guarded = ("/v1/", "/tokenize", "/detokenize") + (("/health", "/metrics") if protect_health_and_metrics else ())
        app.add_middleware(_ApiKeyGate, api_keys=api_keys, guarded=guarded, rate_limiter=rate_limiter,
                           pass_preflight=bool(allowed_origins))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.handle(request)

    text = TextCompletions(core, chat.token_text, limits, generation)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await text.handle(request)

    async def _tokenize(request: Request) -> Response:
        try:
            body = await read_json(request, limits.max_body_bytes)
            served_name(core, body.get("model") if isinstance(body, dict) else None)
            return JSONResponse(await tokenize.tokenize(core, body, chat.token_text))
        except EPDError as err:
            return error_response(err)

    async def _detokenize(request: Request) -> Response:
        try:
            body = await read_json(request, limits.max_body_bytes)
            served_name(core, body.get("model") if isinstance(body, dict) else None)
            return JSONResponse(tokenize.detokenize(core, body))
        except EPDError as err:
            return error_response(err)

    for path in ("/tokenize", "/v1/tokenize"):  # vLLM serves the first; some clients ask the second
        app.post(path)(_tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        app.post(path)(_detokenize)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse(tokenize.version())

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


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class _ApiKeyGate:
    """The API key check in front of the app, as plain ASGI: Starlette's function middleware would run
    the app in a task of its own and pass every frame of a stream through a channel (it cost half
    again the router's CPU per streamed token)."""

    _RATED = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app: ASGIApp, *, api_keys: ApiKeys, guarded: tuple[str, ...],
                 rate_limiter: KeyRateLimiter | None, pass_preflight: bool) -> None:
        self.app, self.api_keys, self.guarded = app, api_keys, guarded
        self.rate_limiter, self.pass_preflight = rate_limiter, pass_preflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        # a CORS preflight carries no credentials by design: the CORS layer answers it
        if scope["type"] != "http" or not path.startswith(self.guarded) or (
                self.pass_preflight and scope["method"] == "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            key_id = self.api_keys.check_bearer(Headers(scope=scope).get("authorization"))
        except Unauthenticated as err:
            response = error_response(err)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        if self.rate_limiter is not None and path in self._RATED:
            try:
                self.rate_limiter.admit(key_id)
            except Overloaded as err:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
