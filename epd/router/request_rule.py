"""The rule a chat request meets once its front end (HTTP or the public gRPC API) has read its
fields: its grammar compiles, tools and their choice become a rendering plan (and, for required
or named calls, the grammar the output is held to, which no other structured output may join),
and ``n`` is within range. One rule, so the two APIs refuse the same requests with the same words.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from epd.engine.grammar import check_grammar
from epd.errors import InvalidRequest
from epd.router.tool_calls import plan_tools
from epd.types import ChatRequest, SamplingParams

MAX_CHOICES = 16  # n: choices of one request (each is a sequence on the tiers)


def chat_request(*, messages: list[dict], sampling: SamplingParams, request_id: str, n: int | None,
                 tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                 structured_param: str = "structured", **fields: Any) -> ChatRequest:
    """A ``ChatRequest`` from what a front end read; ``structured_param`` names the field that
    gave ``sampling.structured`` in the error when its grammar does not compile. ``fields``: the
    rest of ``ChatRequest``, as they came."""
    if sampling.structured is not None:
        try:
            check_grammar(sampling.structured)
        except InvalidRequest as err:
            raise InvalidRequest(f"{structured_param}: {err.message}", param=structured_param) from None
    plan = plan_tools(tools, tool_choice, parallel_tool_calls)
    if plan.grammar is not None:
        if sampling.structured is not None:
            raise InvalidRequest(f"tool_choice required or a named function already constrains the output; give no "
                                 f"{structured_param} with it", param="tool_choice")
        sampling = dataclasses.replace(sampling, structured=plan.grammar)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    return ChatRequest(messages=messages, sampling=sampling, n=n, request_id=request_id, tools=plan.render,
                       parse_tool_calls=plan.parse, **fields)
