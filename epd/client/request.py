"""Caller inputs -> ChatGenerateRequest: a prompt or OpenAI-style messages, images as paths, bytes,
PIL images or URLs, sampling options (None leaves the server default)."""
from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from epd.client.errors import InvalidRequest
from epd.v1 import common_pb2, router_pb2

# bytes | a local path | a data:/file:/http(s): URL (str) | PIL.Image.Image
ImageInput = Union[bytes, str, os.PathLike, Any]
Messages = Union[str, Sequence[Union[dict, router_pb2.ChatMessage]]]

# Strings with these prefixes are URLs the router resolves; any other string is a local path the SDK reads.
_URL_PREFIXES = ("data:", "file:", "http://", "https://")


def build_request(messages: Messages, *, images: Sequence[ImageInput] = (), videos: Sequence[ImageInput] = (),
                  max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop: str | Sequence[str] | None = None,
                  logprobs: int | bool | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float | None = None, min_p: float = 0.0,
                  logit_bias: Mapping[int, float] | None = None, include_stop_str_in_output: bool = False,
                  stop_token_ids: Sequence[int] = (), min_tokens: int = 0, ignore_eos: bool = False,
                  response_format: Mapping | type | None = None, structured_outputs: Mapping | None = None,
                  tools: Sequence[Mapping] | None = None, tool_choice: str | Mapping | None = None,
                  parallel_tool_calls: bool | None = None, n: int = 1,
                  mm_processor_kwargs: Mapping[str, int] | None = None,
                  timeout_s: float | None = None, request_id: str | None = None) -> router_pb2.ChatGenerateRequest:
    """The request ``EPDClient.chat`` / ``stream`` send; their keyword options are these, named as in
    the OpenAI API and vLLM's extensions (penalties, ``min_p``, ``logit_bias`` keyed by token id,
    ``stop_token_ids``, ``min_tokens``, ``ignore_eos``, ``include_stop_str_in_output``, and structured
    output: ``response_format`` as OpenAI's (or a pydantic model class), or vLLM's
    ``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``), and
    ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as OpenAI's (calls come back in
    ``ChatResult.tool_calls``; messages may carry ``tool_calls`` and ``tool_call_id`` as OpenAI's do), and
    ``n`` choices (deltas carry their ``index``; ``ChatResult.choices`` holds them all)), and
    ``mm_processor_kwargs`` (vLLM's name: ``min_pixels`` / ``max_pixels`` for images and video
    frames, ``fps`` / ``min_frames`` / ``max_frames`` for videos). ``videos``: as ``images``
    (bytes, a path, or a URL), placed after them."""
    try:
        sampling = _sampling(max_tokens, temperature, top_p, top_k, seed, logprobs)
        sampling.presence_penalty, sampling.frequency_penalty, sampling.min_p = (
            presence_penalty, frequency_penalty, min_p)
        if repetition_penalty is not None:
            sampling.repetition_penalty = repetition_penalty
        sampling.logit_bias.update({int(t): float(b) for t, b in (logit_bias or {}).items()})
        sampling.stop_token_ids.extend(int(t) for t in stop_token_ids)
        sampling.min_tokens, sampling.ignore_eos = min_tokens, ignore_eos
        structured = _structured(response_format, structured_outputs)
        if structured is not None:
            sampling.structured.CopyFrom(structured)
        request = router_pb2.ChatGenerateRequest(
            request_id=request_id or "", messages=_messages(messages, images, videos), sampling=sampling,
            stop=[stop] if isinstance(stop, str) else list(stop or ()), timeout_s=timeout_s or 0.0,
            include_stop_str_in_output=include_stop_str_in_output,
            tools_json=json.dumps(list(tools)) if tools else "",
            tool_choice_json=json.dumps(tool_choice) if tool_choice is not None else "", n=n,
            mm_processor_kwargs=dict(mm_processor_kwargs or {}))
        if parallel_tool_calls is not None:
            request.parallel_tool_calls = parallel_tool_calls
        return request
    except InvalidRequest:
        raise
    except (TypeError, ValueError) as exc:  # protobuf refusing a value of the wrong type or range
        raise InvalidRequest(f"invalid request option: {exc}") from exc


def _messages(messages: Messages, images: Sequence[ImageInput], videos: Sequence[ImageInput] = ()
              ) -> list[router_pb2.ChatMessage]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    elif isinstance(messages, dict) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequest(f"expected a prompt string or a non-empty list of messages, got {_describe(messages)}")
    out = [_message(i, m) for i, m in enumerate(messages)]
    if images or videos:
        users = [m for m in out if m.role == "user"]
        if not users:
            raise InvalidRequest("images= / videos= need a user message to attach to; the messages have none")
        # Media go before the text of the last user message, the order Qwen-VL models are trained on.
        parts = [_image_part(f"images[{i}]", image) for i, image in enumerate(images)]
        parts += [_media_part(f"videos[{i}]", video, "video") for i, video in enumerate(videos)]
        old = list(users[-1].content)
        del users[-1].content[:]
        users[-1].content.extend(parts + old)
    return out


def _message(index: int, message: dict | router_pb2.ChatMessage) -> router_pb2.ChatMessage:
    if isinstance(message, router_pb2.ChatMessage):
        return message
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidRequest(f"messages[{index}]: expected a dict with 'role' and 'content', got {_describe(message)}")
    content = message.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [content]
    parts = [_part(f"messages[{index}].content[{j}]", part) for j, part in enumerate(content)]
    calls = [_tool_call(f"messages[{index}].tool_calls[{j}]", call)
             for j, call in enumerate(message.get("tool_calls") or [])]
    return router_pb2.ChatMessage(role=message["role"], content=parts, tool_calls=calls,
                                  tool_call_id=message.get("tool_call_id") or "")


def _tool_call(where: str, call) -> router_pb2.ChatToolCall:
    """An OpenAI-shaped call ({"id", "function": {"name", "arguments"}}), or the SDK's own ToolCall."""
    if isinstance(call, dict):
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        return router_pb2.ChatToolCall(id=call.get("id", ""), name=function.get("name", ""),
                                       arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))
    if hasattr(call, "name") and hasattr(call, "arguments"):
        return router_pb2.ChatToolCall(id=getattr(call, "id", ""), name=call.name, arguments=call.arguments)
    raise InvalidRequest(f"{where}: expected an OpenAI tool call dict or a ToolCall, got {_describe(call)}")


def _part(where: str, part: str | dict) -> router_pb2.ContentPart:
    if isinstance(part, str):
        return router_pb2.ContentPart(text=part)
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return router_pb2.ContentPart(text=part.get("text", ""))
    if kind in ("image_url", "video_url"):
        url = part.get(kind)
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidRequest(f"{where}: {kind} needs a URL string ({{'url': ...}}), got {_describe(url)}")
        return router_pb2.ContentPart(**{kind: url})
    if kind in ("image", "video"):
        return _media_part(where, part.get(kind), kind)
    raise InvalidRequest(f"{where}: expected a part of type 'text', 'image_url', 'image', 'video_url' or 'video', "
                         f"got {_describe(part)}")


def _image_part(where: str, image: ImageInput) -> router_pb2.ContentPart:
    return _media_part(where, image, "image")


def _media_part(where: str, value: ImageInput, modality: str) -> router_pb2.ContentPart:
    """An image or a video as a content part: bytes, a URL the router resolves, a local path the
    SDK reads, or (an image) a PIL image."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return router_pb2.ContentPart(**{f"{modality}_bytes": bytes(value)})
    if isinstance(value, str) and value.startswith(_URL_PREFIXES):
        return router_pb2.ContentPart(**{f"{modality}_url": value})
    if isinstance(value, (str, os.PathLike)):
        try:
            return router_pb2.ContentPart(**{f"{modality}_bytes": Path(value).expanduser().read_bytes()})
        except OSError as exc:
            reason = exc.strerror or exc
            raise InvalidRequest(f"{where}: cannot read {modality} file {os.fspath(value)!r}: {reason}") from exc
    pil = sys.modules.get("PIL.Image")  # a PIL image can only exist once PIL is imported
    if modality == "image" and pil is not None and isinstance(value, pil.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")  # lossless, and every PIL mode the processors accept has a PNG form
        return router_pb2.ContentPart(image_bytes=buf.getvalue())
    extra = " or a PIL image" if modality == "image" else ""
    raise InvalidRequest(f"{where}: expected {modality} bytes, a path{extra}, or a URL, got {_describe(value)}")


MAX_RETRY_WAIT_S = 10.0  # the longest an Overloaded retry waits, whatever the server's hint says


def retry_wait_s(error, attempt: int, max_retries: int, deadline: float, now: float) -> float | None:
    """How long to wait before retrying a call the router refused as overloaded (429 /
    RESOURCE_EXHAUSTED with its Retry-After), or None: give up (out of retries, or past the deadline)."""
    from epd.client.errors import Overloaded

    if not isinstance(error, Overloaded) or attempt >= max_retries:
        return None
    wait_s = min(MAX_RETRY_WAIT_S, error.retry_after_s if error.retry_after_s is not None else 0.5 * 2 ** attempt)
    return wait_s if now + wait_s < deadline else None


def _structured(response_format, structured_outputs) -> common_pb2.StructuredOutput | None:
    if response_format is not None and structured_outputs:
        raise InvalidRequest("give response_format or structured_outputs, not both")
    if isinstance(response_format, type):  # a pydantic model class, as the openai client's parse()
        return common_pb2.StructuredOutput(kind="json_schema", spec=json.dumps(response_format.model_json_schema()))
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            return common_pb2.StructuredOutput(kind="json_object")
        if kind == "json_schema":
            return common_pb2.StructuredOutput(kind="json_schema",
                                               spec=json.dumps(response_format["json_schema"].get("schema", {})))
        if kind != "text":
            raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
        return None
    given = {k: v for k, v in (structured_outputs or {}).items() if v not in (None, False)}
    if len(given) > 1 or set(given) - {"json", "regex", "choice", "grammar", "json_object"}:
        raise InvalidRequest(f"structured_outputs takes one of json, regex, choice, grammar, json_object; got "
                             f"{sorted(given)}")
    for key, value in given.items():
        if key == "json":
            return common_pb2.StructuredOutput(kind="json_schema",
                                               spec=value if isinstance(value, str) else json.dumps(value))
        if key == "choice":
            return common_pb2.StructuredOutput(kind="choice", spec=json.dumps(list(value)))
        kind = {"regex": "regex", "grammar": "lark", "json_object": "json_object"}[key]
        return common_pb2.StructuredOutput(kind=kind, spec="" if key == "json_object" else value)
    return None


def _sampling(max_tokens, temperature, top_p, top_k, seed, logprobs) -> common_pb2.SamplingParams:
    # On the wire 0 means "server default", so the zeros that would be silently replaced are refused here.
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if logprobs is not None and not isinstance(logprobs, bool) and logprobs < 0:
        raise InvalidRequest(f"logprobs must be None, True or an int in [0, 20], got {logprobs}")
    if top_k == 0:
        raise InvalidRequest("top_k must be -1 (whole vocabulary) or >= 1, got 0")
    msg = common_pb2.SamplingParams(max_tokens=max_tokens or 0, top_p=top_p or 0.0, top_k=top_k or 0)
    if temperature is not None:  # unset: the server's default (1.0, OpenAI's), the same as over HTTP
        msg.temperature = temperature
    if seed is not None:
        msg.seed = seed
    if logprobs is True:
        msg.logprobs = 0  # the sampled token's logprob only
    elif logprobs is not None and logprobs is not False:
        msg.logprobs = logprobs
    return msg


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``api_key`` to a router that requires one (none without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
