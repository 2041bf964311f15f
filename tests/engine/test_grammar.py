"""Structured output on the engine, with a random-weight preset (which on its own writes anything):
a JSON schema's output parses and validates, greedy and sampled; a regex and a choice match in full;
an open JSON object never leaves valid JSON; an imported request's matcher continues from its first
token as decode's does; a grammar that does not compile fails its own request at admission."""
from __future__ import annotations

import json
import re

import pytest

from epd.config import EngineConfig
from epd.engine.grammar import GrammarCompiler
from epd.errors import InvalidRequest
from epd.llm import LLM
from epd.models.locate import resolve_model
from epd.types import SamplingParams, StructuredOutput

jsonschema = pytest.importorskip("jsonschema")  # a test dependency (the GPU image has none: it skips there)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
CHAT = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(resolve_model("tiny-qwen2-vl")), engine_config=EngineConfig())


def _run(llm, kind: str, spec: str = "", **params):
    params = {"max_tokens": 160, **params}
    return llm.chat(CHAT, SamplingParams(structured=StructuredOutput(kind, spec), **params))[0]


@pytest.mark.parametrize("params", [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in range(4)])
def test_a_json_schema_gives_json_that_validates(llm, params):
    out = _run(llm, "json_schema", json.dumps(SCHEMA), **params)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_without_the_grammar_the_same_model_writes_no_json(llm):
    free = llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0.0))[0].text
    with pytest.raises(ValueError):
        json.loads(free)


def test_a_regex_a_choice_and_a_lark_grammar_match_in_full(llm):
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _run(llm, "regex", r"[0-9]{3}-[a-z]{2}", temperature=1.0, seed=1).text)
    assert _run(llm, "choice", json.dumps(["left", "right", "up"]), temperature=1.0, seed=2).text in {
        "left", "right", "up"}
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    assert re.fullmatch(r"x=[1-9][0-9]?;", _run(llm, "lark", lark, temperature=1.0, seed=3).text)
    ebnf = 'root ::= "yes" | "no"'  # vLLM's guided_grammar form, converted to Lark
    assert _run(llm, "lark", ebnf, temperature=1.0, seed=4).text in {"yes", "no"}


def test_an_open_json_object_never_leaves_valid_json(llm):
    """Random weights rarely close a free string, so the output may be cut by max_tokens; every
    token of it is still valid JSON so far (a fresh matcher takes them all)."""
    out = _run(llm, "json_object", max_tokens=40, temperature=1.0, seed=5)
    assert out.text.startswith("{")
    matcher = llm.engine.grammar_compiler.matcher(StructuredOutput("json_object"))
    assert matcher.consume_tokens(out.token_ids), matcher.get_error()
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_an_imported_request_continues_its_grammar_from_the_first_token(llm):
    compiler: GrammarCompiler = llm.engine.grammar_compiler
    spec = StructuredOutput("regex", "ab+c")
    first = compiler.tokenizer_view().tokenize_str("a")[0]
    matcher = compiler.matcher(spec, (first,))  # what decode builds for a request whose first token is "a"
    assert not matcher.is_error() and not matcher.is_accepting()
    with pytest.raises(InvalidRequest, match="does not match its structured output"):
        compiler.matcher(spec, tuple(compiler.tokenizer_view().tokenize_str("x")))


def test_a_grammar_that_does_not_compile_fails_its_request_alone(llm):
    with pytest.raises(InvalidRequest, match="does not compile"):
        llm.engine.add_request([1, 2, 3], SamplingParams(structured=StructuredOutput("regex", "a(")))
    assert not llm.engine.has_unfinished
