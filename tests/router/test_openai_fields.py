"""No OpenAI or vLLM request field is silently ignored: each one works, is informational, or asks for
something this server does not do and gets a 400 naming it; its do-nothing values are accepted;
an unknown field is logged once. docs/openai-compat.md is the table in the code."""
from __future__ import annotations

import logging
from pathlib import Path

import openai
import pytest

from epd.router.openai import fields as openai_fields
from epd.router.openai.fields import CHAT_FIELDS, RULES, markdown_table
from epd.router.openai.requests import ChatCompletionRequest
from tests.router.test_http_app import create, served

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-compat.md"

# a value that asks for something, per refused field
ASKING = {"store": True, "service_tier": "flex",
          "functions": [{"name": "f"}], "function_call": "auto",
          "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
          "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high", "verbosity": "low",
          "web_search_options": {}, "length_penalty": 0.5,
          "use_beam_search": True, "best_of": 2, "skip_special_tokens": False,
          "spaces_between_special_tokens": False, "truncate_prompt_tokens": 10, "prompt_logprobs": 1, "echo": True,
          "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
          "documents": [{"text": "d"}], "chat_template": "{{ 1 }}",
          "guided_whitespace_pattern": " ", "priority": 5,
          "return_tokens_as_token_ids": True, "cache_salt": "s",
          "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "bad_words": ["x"], "allowed_token_ids": [1],
          "logits_processors": ["x"]}
# what clients send unasked: accepted
DEFAULTS = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "n": 1, "store": False, "service_tier": "auto", "response_format": {"type": "text"}, "min_p": 0.0,
            "repetition_penalty": 1.0, "best_of": 1, "skip_special_tokens": True, "echo": False,
            "add_generation_prompt": True, "modalities": ["text"], "user": "u-1", "metadata": {"k": "v"}}


def test_the_docs_page_is_the_table_in_the_code():
    page = DOC.read_text()
    table = page.split("<!-- table: generated -->\n", 1)[1].split("<!-- end of table -->", 1)[0]
    assert table == markdown_table(), "regenerate: python -m epd.router.openai.fields"


def test_every_field_the_request_model_reads_is_in_the_table_and_every_working_one_is_read():
    read = set(ChatCompletionRequest.model_fields)
    assert read <= set(RULES), read - set(RULES)
    working = {rule.name for rule in CHAT_FIELDS if rule.status == "works"}
    assert working <= read, working - read
    refused = {rule.name for rule in CHAT_FIELDS if rule.status == "refused"}
    assert refused == set(ASKING), refused ^ set(ASKING)  # each refused field is tried below


@pytest.mark.parametrize("name", sorted(ASKING))
def test_a_refused_field_that_asks_for_something_is_a_400_naming_it(name):
    with served() as (core, _, client):
        with pytest.raises(openai.BadRequestError) as info:
            create(client, extra_body={name: ASKING[name]})
    assert f"{name} is not supported by this server" in info.value.message
    assert info.value.body["param"] == name and core.requests == []


def test_do_nothing_values_are_accepted():
    with served() as (core, _, client):
        assert create(client, extra_body=DEFAULTS).choices[0].message.content == "Hello, world!"
    assert len(core.requests) == 1


def test_an_unknown_field_is_logged_once_and_ignored(caplog):
    openai_fields._logged_unknown.discard("frobnicate")
    with caplog.at_level(logging.WARNING, logger="epd.router.http"), served() as (_, _, client):
        for _ in range(3):
            assert create(client, extra_body={"frobnicate": 1}).choices[0].message.content
    assert caplog.text.count("ignoring the unknown request field 'frobnicate'") == 1


