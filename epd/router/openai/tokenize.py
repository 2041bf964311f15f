"""vLLM's ``/tokenize`` and ``/detokenize`` (counting exactly what generation counts: the same
template, images expanded to their rows) and ``/version``.
"""
from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from epd.errors import InvalidRequest
from epd.router.openai.requests import ChatMessage, Lenient, message_dict, validation_error
from epd.types import ChatRequest, SamplingParams

_ONE_TOKEN = SamplingParams(max_tokens=1)
class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[dict] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


async def tokenize(core, body: Any, token_text) -> dict:
    try:
        parsed = TokenizeRequest.model_validate(body if isinstance(body, Mapping) else {})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if (parsed.prompt is None) == (parsed.messages is None):
        raise InvalidRequest("give prompt (text) or messages (a chat), one of them", param="prompt")
    placeholder = ChatRequest(messages=[message_dict(m) for m in parsed.messages or []], sampling=_ONE_TOKEN,
                              request_id="tokenize", prompt=parsed.prompt, tools=parsed.tools)
    prompt = await core.prompt_of(placeholder, add_generation_prompt=parsed.add_generation_prompt)
    ids = list(prompt.prompt_token_ids)
    out = {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids}
    if parsed.return_token_strs:
        out["token_strs"] = [token_text(t) for t in ids]
    return out


def detokenize(core, body: Any) -> dict:
    try:
        parsed = DetokenizeRequest.model_validate(body if isinstance(body, Mapping) else {})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return {"prompt": core.detokenize(parsed.tokens)}


def version() -> dict:
    try:
        return {"version": importlib.metadata.version("epd")}
    except importlib.metadata.PackageNotFoundError:  # a checkout that was never installed
        return {"version": "unknown"}
