"""The OpenAI Chat Completions API's requests as the official ``openai`` client sends them:
pydantic models for the wire, and the one conversion into the router's ``ChatRequest``.

Wire types stop here: ``to_chat_request`` turns a body into a ``ChatRequest`` once (through the
rule both APIs share, ``epd.router.request_rule``). Extensions beyond OpenAI (vLLM-style):
``top_k``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``. What every
other OpenAI and vLLM field gets (informational, or a 400 naming it) is the table in ``fields``;
a field in neither list is logged once and ignored, as vLLM does.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import orjson
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from epd.errors import InvalidRequest, NotFound, PayloadTooLarge
from epd.models.generation_config import OPENAI_DEFAULTS, GenerationDefaults
from epd.router.api import RouterCore
from epd.router.openai.fields import check_chat_fields
from epd.router.request_rule import chat_request
from epd.router.tool_calls import arguments_for_template
from epd.types import MAX_TOKENS_TO_FILL, ChatRequest, SamplingParams, StructuredOutput

MAX_TOP_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(Lenient):
    url: str
    detail: str | None = None  # "auto" | "low" | "high": accepted, not used by Qwen-VL


class TextPart(Lenient):
    type: Literal["text"]
    text: str


def _url_as_string(value: Any) -> Any:
    return {"url": value} if isinstance(value, str) else value  # vLLM accepts a bare string too


class ImageURLPart(Lenient):
    type: Literal["image_url"]
    image_url: ImageURL

    _bare_url = field_validator("image_url", mode="before")(_url_as_string)


class VideoURL(Lenient):
    url: str


class VideoURLPart(Lenient):
    """vLLM's video part: ``{"type": "video_url", "video_url": {"url": ...}}``."""

    type: Literal["video_url"]
    video_url: VideoURL

    _bare_url = field_validator("video_url", mode="before")(_url_as_string)


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class FunctionCall(Lenient):
    name: str
    arguments: str | dict = "{}"  # OpenAI sends JSON text; a dict is taken too


class MessageToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, rendered back into the prompt
    tool_call_id: str | None = None  # a tool message: which call it answers


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a stream option we do not know is a 400, not a silent drop
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk (guidellm asks for it)


class GenerationFields(Lenient):
    """What chat completions and (text) completions requests share: the model and how to sample."""

    model: str | None = None  # one of the served names (else 404); none: the first
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's shape: token id (as a string) -> bias
    include_stop_str_in_output: bool = False
    request_id: str | None = None  # vLLM's: the id's base, as the X-Request-Id header
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs: dict | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: dict | str | None = None  # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None  # vLLM's: min_pixels / max_pixels (checked against the checkpoint)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables_only(cls, value: dict | None) -> dict | None:
        taken = sorted(set(value or {}) & _TEMPLATE_ARGUMENTS)
        if taken:  # these are the server's to set: a request overriding them would change the prompt's shape
            raise ValueError(f"{taken} are set by the server, not by chat_template_kwargs")
        return value


_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt",
                       "continue_final_message", "chat_template", "return_dict", "return_assistant_tokens_mask"}


def parse_chat_body(body: Any) -> ChatCompletionRequest:
    """A decoded JSON body -> the request model, or a 400 naming the first field that is wrong."""
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"expected a JSON object as the request body, got {type(body).__name__}")
    check_chat_fields(body)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: list[dict]) -> InvalidRequest:
    # A union reports one error per member; the deepest one is what the client got wrong.
    deepest = max(errors, key=lambda e: len(e["loc"]))
    param = _error_location(deepest["loc"])
    same_place = [e for e in errors if _error_location(e["loc"]) == param]
    messages = list(dict.fromkeys(e["msg"] for e in same_place))
    got = "" if deepest["type"] == "missing" else f"; got {_short(deepest.get('input'))}"
    return InvalidRequest(f"{param or 'body'}: {', or '.join(messages)}{got}", param=param or None)


_TYPE_LABELS = ("str", "int", "float", "bool")


def _error_location(loc: Sequence[Any]) -> str:
    # ("messages", 0, "content", "list[tagged-union[...]]", 1, "image_url", "image_url", "url")
    #   -> "messages[0].content[1].image_url.url": union member labels and tags are pydantic's, not the client's
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_LABELS or "[" in part:
            continue
        elif i >= 2 and isinstance(loc[i - 1], int) and "tagged-union" in str(loc[i - 2]):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def request_id_base(header: str | None, body: GenerationFields) -> str | None:
    """The client's own request id (the X-Request-Id header, else vLLM's ``request_id`` field),
    checked: it lands in responses, logs and the workers' ids."""
    for name, value in (("X-Request-Id", header), ("request_id", body.request_id)):
        if value:
            if len(value) > 128 or not all(c.isprintable() and not c.isspace() for c in value):
                raise InvalidRequest(f"{name} must be at most 128 printable characters without spaces, got "
                                     f"{_short(value, 40)}", param="request_id")
            return value
    return None


def to_chat_request(body: ChatCompletionRequest | Mapping, request_id: str, *,
                    default_max_tokens: int | None = None,
                    defaults: GenerationDefaults = OPENAI_DEFAULTS) -> ChatRequest:
    """Validate sampling values against OpenAI semantics and convert once into a ``ChatRequest``.
    Image parts keep their ``image_url``; the router's pipeline turns them into bytes."""
    if not isinstance(body, ChatCompletionRequest):
        body = parse_chat_body(body)
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    given = body.max_completion_tokens is not None or body.max_tokens is not None
    structured_param, structured = structured_output(body)
    return chat_request(
        messages=[message_dict(m) for m in body.messages], request_id=request_id, n=body.n,
        sampling=sampling_params(body, default_max_tokens, _num_logprobs(body), structured, defaults),
        structured_param=structured_param, tools=body.tools, tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls, stop_strings=stop_strings(body.stop),
        fill_max_tokens=not given and default_max_tokens is None and defaults.max_tokens is None,
        include_stop_str_in_output=body.include_stop_str_in_output,
        chat_template_kwargs=body.chat_template_kwargs or None, mm_processor_kwargs=body.mm_processor_kwargs or None)


def sampling_params(body: GenerationFields, default_max_tokens: int | None, num_logprobs: int | None,
                    structured: StructuredOutput | None,
                    defaults: GenerationDefaults = OPENAI_DEFAULTS) -> SamplingParams:
    """The request's SamplingParams, each value checked against OpenAI's (and vLLM's) range; a field
    it leaves unset takes ``defaults`` (OpenAI's, or the checkpoint's generation_config.json)."""
    max_completion_tokens = getattr(body, "max_completion_tokens", None)
    max_tokens = max_completion_tokens if max_completion_tokens is not None else body.max_tokens
    max_name = "max_completion_tokens" if max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = next((m for m in (default_max_tokens, defaults.max_tokens) if m is not None), MAX_TOKENS_TO_FILL)
    _require(max_tokens >= 1, max_name, "an integer >= 1", max_tokens)
    _require(body.min_tokens >= 0 and (body.min_tokens <= max_tokens), "min_tokens",
             f"in [0, {max_name}={max_tokens}]", body.min_tokens)
    temperature = defaults.temperature if body.temperature is None else body.temperature
    _require(math.isfinite(temperature) and 0.0 <= temperature <= 2.0, "temperature", "in [0, 2]", temperature)
    top_p = defaults.top_p if body.top_p is None else body.top_p
    _require(math.isfinite(top_p) and 0.0 < top_p <= 1.0, "top_p", "in (0, 1]", top_p)
    top_k = defaults.top_k if body.top_k is None else (-1 if body.top_k == 0 else body.top_k)  # 0, -1: everything
    _require(top_k == -1 or top_k >= 1, "top_k", "-1, 0 (disabled) or >= 1", body.top_k)
    _require(body.seed is None or _INT64_MIN <= body.seed <= _INT64_MAX, "seed", "a 64-bit integer", body.seed)
    return SamplingParams(max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()),
                          ignore_eos=body.ignore_eos, logprobs=num_logprobs, **_processors(body, defaults),
                          structured=structured)


_GUIDED_BACKENDS = ("auto", "guidance", "llguidance")


def structured_output(body: GenerationFields) -> tuple[str, StructuredOutput | None]:
    """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` / ``guided_*`` as one grammar
    (at most one may be given), with the name of the field that gave it (the request rule names it
    when the grammar does not compile)."""
    found = [(name, so) for name, so in _structured_candidates(body) if so is not None]
    if len(found) > 1:
        raise InvalidRequest(f"give one structured output, got {' and '.join(name for name, _ in found)}",
                             param=found[1][0])
    if body.guided_decoding_backend not in (None, *_GUIDED_BACKENDS):
        raise InvalidRequest(f"guided_decoding_backend must be one of {', '.join(_GUIDED_BACKENDS)} (this server "
                             f"runs llguidance), got {body.guided_decoding_backend!r}", param="guided_decoding_backend")
    return found[0] if found else ("response_format", None)


def _structured_candidates(body: GenerationFields):
    yield "response_format", _response_format(body.response_format)
    outputs = body.structured_outputs or {}
    keys = ("json", "regex", "choice", "grammar", "json_object")
    given = [key for key in keys if outputs.get(key) not in (None, False)]
    unknown = set(outputs) - {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern"}
    if unknown or outputs.get("whitespace_pattern") is not None:
        raise InvalidRequest(f"structured_outputs takes json, regex, choice, grammar or json_object, got "
                             f"{sorted(unknown or {'whitespace_pattern'})}", param="structured_outputs")
    if len(given) > 1:
        raise InvalidRequest(f"structured_outputs takes one of json, regex, choice, grammar, json_object; got {given}",
                             param="structured_outputs")
    for key in given:
        yield f"structured_outputs.{key}", _from_vllm(key, outputs[key])
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        yield f"guided_{key}", None if value is None else _from_vllm(key, value)


def _response_format(value: dict | None) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise InvalidRequest("response_format.json_schema must be an object with a schema object, got "
                                 f"{_short(spec)}", param="response_format")
        return StructuredOutput("json_schema", json.dumps(spec.get("schema", {})))
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         param="response_format")


def _from_vllm(key: str, value) -> StructuredOutput:
    if key == "json":
        return StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value))
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "choice":
        return StructuredOutput("choice", json.dumps(value))
    if key == "regex":
        return StructuredOutput("regex", value)
    return StructuredOutput("lark", value)  # EBNF or Lark: the grammar module reads both


def _processors(body: GenerationFields, defaults: GenerationDefaults) -> dict:
    """The penalties, min_p and logit_bias, checked against OpenAI's (and vLLM's) ranges."""
    out = {}
    for name, default, ok, expected in (
            ("presence_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", defaults.repetition_penalty, lambda v: 0.0 < v <= 2.0, "in (0, 2]"),
            ("min_p", defaults.min_p, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")):
        value = getattr(body, name)
        value = default if value is None else value
        _require(math.isfinite(value) and ok(value), name, expected, value)
        out[name] = value
    bias = []
    for key, value in (body.logit_bias or {}).items():
        _require(key.isdigit(), "logit_bias", "keyed by token ids (strings of digits)", key)
        _require(math.isfinite(value) and -100.0 <= value <= 100.0, "logit_bias", "values in [-100, 100]", value)
        bias.append((int(key), float(value)))
    out["logit_bias"] = tuple(sorted(bias))
    return out


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    top = body.top_logprobs
    _require(top is None or 0 <= top <= MAX_TOP_LOGPROBS, "top_logprobs", f"in [0, {MAX_TOP_LOGPROBS}]", top)
    if not body.logprobs:
        _require(not top, "logprobs", "true when top_logprobs > 0", body.logprobs)
        return None
    return top or 0


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for i, s in enumerate(stops):
        _require(s != "", "stop", "non-empty strings", f"an empty string at index {i}")
    return list(dict.fromkeys(stops))


def message_dict(message: ChatMessage) -> dict:
    # "developer" is OpenAI's newer name for "system"; chat templates only know the latter
    role = "system" if message.role == "developer" else message.role
    content: str | list[dict] = message.content if message.content is not None else ""
    if isinstance(content, list):
        content = [part.model_dump(exclude_none=True) for part in content]
    out = {"role": role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        # arguments as a JSON object, which the chat template writes into the call as the model wrote it
        out["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": arguments_for_template(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _require(ok: bool, param: str, expected: str, got: Any) -> None:
    if not ok:
        raise InvalidRequest(f"{param} must be {expected}, got {got!r}", param=param)


def served_name(core: RouterCore, model: str | None) -> str:
    """The served name a request asked for (none: the first); any other name is a 404, as vLLM's."""
    if model is None:
        return core.model_name
    if model not in core.served_model_names:
        served = ", ".join(repr(name) for name in core.served_model_names)
        raise NotFound(f"the model {model!r} does not exist; this server serves {served}", param="model")
    return model


async def read_json(request: Request, max_bytes: int):
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
    body = b"".join(chunks)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass  # the standard parser says what is wrong in its words (and takes integers past 64 bits)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # [[[[...: the parser gives up before the body ends
        raise InvalidRequest("the request body nests JSON arrays or objects too deeply to parse") from None
