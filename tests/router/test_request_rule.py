"""One rule for a chat request, whichever API it came through: the HTTP body and the gRPC message
that ask for the same thing are refused with the same words, or give the same ChatRequest."""
from __future__ import annotations

import json

import pytest

from epd.errors import InvalidRequest
from epd.router.grpc_api import RouterGrpcServicer
from epd.router.openai.requests import to_chat_request
from epd.v1 import common_pb2, router_pb2

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def over_http(**fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    return to_chat_request(body, "req-1")


def over_grpc(*, n: int = 0, tools=None, tool_choice=None, structured: tuple[str, str] | None = None):
    sampling = common_pb2.SamplingParams(max_tokens=8)
    if structured is not None:
        sampling.structured.kind, sampling.structured.spec = structured
    message = router_pb2.ChatGenerateRequest(
        messages=[router_pb2.ChatMessage(role="user", content=[router_pb2.ContentPart(text="hi")])],
        sampling=sampling, n=n, tools_json=json.dumps(tools) if tools else "",
        tool_choice_json=json.dumps(tool_choice) if tool_choice else "")
    return RouterGrpcServicer(core=None)._chat_request(message, "req-1", None)


def refusal(build, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        build(**kwargs)
    return info.value


@pytest.mark.parametrize("http_fields, grpc_fields, expected", [
    ({"n": 17}, {"n": 17}, "n must be in [1, 16], got 17"),
    ({"tools": [TOOL], "tool_choice": NAMED, "guided_json": SCHEMA},
     {"tools": [TOOL], "tool_choice": NAMED, "structured": ("json_schema", json.dumps(SCHEMA))},
     "tool_choice required or a named function already constrains the output; give no {field} with it"),
    ({"guided_regex": "(unclosed"}, {"structured": ("regex", "(unclosed")},
     "{field}: structured output (regex) does not compile"),
], ids=["n", "named tool and a grammar", "grammar that does not compile"])
def test_both_apis_refuse_the_same_request_with_the_same_words(http_fields, grpc_fields, expected):
    http, grpc = refusal(over_http, **http_fields), refusal(over_grpc, **grpc_fields)
    # the same words; where a field is named, each API names its own ("guided_json", "sampling.structured")
    http_field = next((name for name in http_fields if name.startswith("guided_")), "")
    assert http.message.startswith(expected.format(field=http_field))
    assert grpc.message.startswith(expected.format(field="sampling.structured"))
    assert http.message.replace(http_field, "sampling.structured") == grpc.message if http_field else (
        http.message == grpc.message)


def test_a_named_tool_holds_the_output_to_its_grammar_through_either_api():
    http = over_http(tools=[TOOL], tool_choice=NAMED, n=2)
    grpc = over_grpc(tools=[TOOL], tool_choice=NAMED, n=2)
    assert http.sampling.structured is not None
    assert http.sampling.structured == grpc.sampling.structured
    assert (http.n, http.tools, http.parse_tool_calls) == (grpc.n, grpc.tools, grpc.parse_tool_calls) == (
        2, [TOOL], True)
