"""Hermes-format tool calls: the plan for each tool_choice, the grammar that forces valid calls,
and parsing them out of text, whole or streamed in any split."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from epd.errors import InvalidRequest
from epd.router.tool_calls import ToolCallStream, parse_tool_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_plans_follow_tool_choice():
    assert plan_tools(None, None, None) == plan_tools([], "none", None)
    assert plan_tools([WEATHER], None, None).render == [WEATHER] and plan_tools([WEATHER], None, None).parse
    none = plan_tools([WEATHER], "none", None)
    assert none.render is None and not none.parse
    assert plan_tools([WEATHER], "auto", None).grammar is None
    required = plan_tools([WEATHER, TIME], "required", None).grammar
    assert required.kind == "lark" and "get_weather" in required.spec and "get_time" in required.spec
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False).grammar
    assert "get_time" in named.spec and "get_weather" not in named.spec and 'start: call\n' in named.spec
    for grammar in (required, named):
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar.spec)) == ""


@pytest.mark.parametrize("tools, choice, match", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([WEATHER], "sometimes", "tool_choice must be none, auto, required"),
    ([{"type": "function", "function": {}}], "auto", r"tools\[0\] must be"),
    (None, "required", "needs tools"),
])
def test_bad_tools_and_choices_are_400s(tools, choice, match):
    with pytest.raises(InvalidRequest, match=match):
        plan_tools(tools, choice, None)


def test_calls_are_parsed_out_of_the_text():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])  # not a call: the model's text as it is


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_stream_in_any_split_gives_the_same_content_and_calls(step):
    stream, content, calls = ToolCallStream(), [], []
    for i in range(0, len(TEXT), step):
        text, done = stream.feed(TEXT[i:i + step])
        content.append(text)
        calls += done
    content.append(stream.flush())
    assert "".join(content) == "Let me check.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    plain = ToolCallStream()
    assert plain.feed("a <tool") == ("a ", []) and plain.feed("s are ok") == ("<tools are ok", [])
