"""Tool calling in the Hermes format the Qwen models write (and Qwen2.5's chat template renders):
each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. The router turns a
request's ``tools`` and ``tool_choice`` into what the chat template and the sampler need, and the
model's text back into OpenAI ``tool_calls``:

- ``auto``: the tools are rendered; whatever calls the model writes are parsed out of its text;
- ``none``: the tools are not rendered and nothing is parsed (OpenAI: the model will not call);
- ``required`` / a named function: also a grammar (``StructuredOutput("lark")``) that makes the
  output one or more calls (one with ``parallel_tool_calls: false``) of those tools whose
  arguments match their JSON schemas: the call is always valid, even from random weights.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epd.errors import InvalidRequest
from epd.types import StructuredOutput, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this request: the tools to render (None: none), whether to
    parse calls out of the output, and the grammar that forces calls (required / named)."""

    render: list[dict] | None
    parse: bool
    grammar: StructuredOutput | None


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    tools = tools or []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                              Mapping) \
                or not isinstance(tool["function"].get("name"), str) or not tool["function"]["name"]:
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                 f"\"parameters\": ...}}}}, got {str(tool)[:80]}", param=f"tools[{i}]")
    choice = "auto" if tool_choice is None and tools else ("none" if tool_choice is None else tool_choice)
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise InvalidRequest(f"tool_choice {str(choice)[:60]} needs tools", param="tool_choice")
        return ToolPlan(None, False, None)
    if choice == "auto":
        return ToolPlan(list(tools), True, None)
    if choice == "required":
        forced = list(tools)
    elif isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"),
                                                                                           Mapping):
        name = choice["function"].get("name")
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools "
                                 f"({', '.join(t['function']['name'] for t in tools)})", param="tool_choice")
    else:
        raise InvalidRequest(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ...}}}}, got {str(choice)[:80]}", param="tool_choice")
    return ToolPlan(list(tools), True, calls_grammar(forced, one_only=parallel is False))


def calls_grammar(tools: list[dict], *, one_only: bool) -> StructuredOutput:
    """A Lark grammar (llguidance's, with %json) for one call, or several separated by a newline,
    each naming one of ``tools`` with arguments valid for its parameters."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    schema = {"anyOf": options, "x-guidance": {"whitespace_flexible": False}}
    calls = "call" if one_only else 'call ("\\n" call)*'
    return StructuredOutput("lark", f'start: {calls}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n')


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text before the first call, or None when empty; the calls). A block that is not a call
    (not JSON, no name) leaves the whole text as content, the way a model's prose would be."""
    if OPEN not in text:
        return text, []
    content, rest = text.split(OPEN, 1)
    calls = []
    for block in (OPEN + rest).split(OPEN)[1:]:
        body = block.split(CLOSE, 1)[0]
        call = _call(body)
        if call is None:
            return text, []
        calls.append(call)
    return (content.strip() or None), calls


def _call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    return ToolCall(data["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


class ToolCallStream:
    """The streamed side of ``parse_tool_calls``: content goes out as it comes, but for a suffix
    that may still grow into ``<tool_call>``; from the first call on, text is held and each call
    goes out whole when its ``</tool_call>`` arrives."""

    def __init__(self) -> None:
        self._held = ""
        self._in_calls = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self._held += text
        if not self._in_calls:
            if OPEN in self._held:
                content, self._held = self._held.split(OPEN, 1)
                self._held = OPEN + self._held
                self._in_calls = True
                return content, self._complete()
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._held)), 0, -1)
                         if self._held.endswith(OPEN[:k])), 0)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            return out, []
        return "", self._complete()

    def flush(self) -> str:
        """At the end: held text that did not become a call goes out as content (an unfinished
        call, cut by max_tokens, is dropped)."""
        held, self._held = self._held, ""
        return "" if self._in_calls else held

    def _complete(self) -> list[ToolCall]:
        done = []
        while CLOSE in self._held:
            block, self._held = self._held.split(CLOSE, 1)
            call = _call(block.split(OPEN, 1)[-1])
            if call is not None:
                done.append(call)
        self.calls += done
        return done


def arguments_for_template(arguments: str | dict) -> dict | str:
    """A call's arguments as the chat template writes them: the JSON object itself."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: written as it came
    return value if isinstance(value, dict) else arguments
