"""The OpenAI API's responses as its clients read them: pydantic models for whole responses, chunks
and errors, and the logprobs entries that both carry; and the frames a stream sends per token,
written as bytes (``ChunkHead``, ``usage_json``).

A stream's chunks differ from one another only in their choice: the id, object, created and model
are the same bytes every time, and a text delta is one JSON string. Building and dumping a pydantic
model for each token was a fifth of the router's work per token, so the common chunks (text, with
token ids and running usage if asked) are joined from bytes here; the rare ones (the role, tool
calls, logprobs, finish, errors) still go through the models. Both spell the same JSON (a test
holds them equal).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import orjson
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from epd.errors import EPDError
from epd.types import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf; what vLLM sends for a token of probability 0


def _omit_if_none() -> Any:
    """An optional field that is left out of the JSON when unset (extensions), not sent as null."""
    return Field(default=None, exclude_if=lambda value: value is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


def logprobs_content(entries: Sequence[TokenLogprobs], token_text: Callable[[int], str],
                     num_top: int) -> list[TokenLogprob]:
    """Engine logprobs -> OpenAI ``logprobs.content`` entries, top alternatives most likely first."""
    out = []
    for entry in entries:
        top = sorted(entry.top.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
        out.append(TokenLogprob(**_logprob_fields(entry.token_id, entry.logprob, token_text),
                                top_logprobs=[TopLogprob(**_logprob_fields(t, lp, token_text)) for t, lp in top]))
    return out


def _logprob_fields(token_id: int, logprob: float, token_text: Callable[[int], str]) -> dict:
    text = token_text(token_id)
    return {"token": text, "logprob": max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB,
            "bytes": list(text.encode("utf-8"))}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: DeltaFunction


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id; None for EOS or length
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = _omit_if_none()  # extension: return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = _omit_if_none()  # extension: return_token_ids


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _omit_if_none()
    content: str | None = _omit_if_none()
    tool_calls: list[DeltaToolCall] | None = _omit_if_none()


class StreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = _omit_if_none()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[StreamChoice]
    usage: Usage | None = _omit_if_none()  # only on the last chunk, with stream_options.include_usage
    prompt_token_ids: list[int] | None = _omit_if_none()  # first chunk, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "epd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None  # the HTTP status, as vLLM sends it


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def of(cls, status: int, message: str, error_type: str, param: str | None = None) -> "ErrorResponse":
        return cls(error=ErrorInfo(message=message, type=error_type, param=param, code=status))

    @classmethod
    def of_error(cls, err: EPDError) -> "ErrorResponse":
        return cls.of(err.http_status, err.message, err.code.openai_type, err.param)


def error_response(err: EPDError) -> JSONResponse:
    """An ``EPDError`` as OpenAI sends errors; 429 carries Retry-After in whole seconds."""
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(0, math.ceil(err.retry_after_s)))
    return JSONResponse(ErrorResponse.of_error(err).model_dump(), status_code=err.http_status, headers=headers)


class TokenText:
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


def usage_json(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> bytes:
    """``Usage.of(...)`` as its JSON."""
    return (b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":'
            b'{"cached_tokens":%d}}' % (num_prompt_tokens, num_completion_tokens,
                                        num_prompt_tokens + num_completion_tokens, num_cached_tokens))


class ChunkHead:
    """The bytes every chunk of one stream starts with, up to its choices."""

    def __init__(self, request_id: str, object_name: str, created: int, model: str) -> None:
        self.head = (b'data: {"id":' + orjson.dumps(request_id) + b',"object":' + orjson.dumps(object_name)
                     + b',"created":%d,"model":' % created + orjson.dumps(model) + b',"choices":[')

    def chat_text(self, index: int, text: str, token_ids: list[int] | None, usage: bytes | None) -> bytes:
        """A chat chunk whose delta is ``text`` (``token_ids``: with return_token_ids; ``usage``:
        with continuous usage), as ``ChatCompletionChunk`` spells it."""
        return b"".join((
            self.head, b'{"index":%d,"delta":{"content":' % index, orjson.dumps(text),
            b'},"finish_reason":null,"stop_reason":null,"logprobs":null',
            b"" if token_ids is None else b',"token_ids":' + orjson.dumps(token_ids), b"}]",
            b"" if usage is None else b',"usage":' + usage, b"}\n\n"))

    def completion_text(self, text: str, usage: bytes | None) -> bytes:
        """A text completion's chunk of ``text``, as ``CompletionResponse`` spells it (its usage is
        null unless given)."""
        return b"".join((self.head, b'{"index":0,"text":', orjson.dumps(text),
                         b',"finish_reason":null,"stop_reason":null,"logprobs":null}],"usage":',
                         b"null" if usage is None else usage, b"}\n\n"))
