"""A stream's text chunks are joined from bytes, not dumped from pydantic models: they must spell
the same JSON as the models do, for any text."""
from __future__ import annotations

import json

import pytest

from epd.router.openai.completions import CompletionChoice, CompletionResponse
from epd.router.openai.responses import ChatCompletionChunk, ChunkHead, DeltaMessage, StreamChoice, Usage, usage_json

TEXTS = ["Hello", "", " wörld ", 'quote " backslash \\ slash /', "line\nbreak\ttab\r", "\x00\x1f\x7f",
         "emoji 🙂 and 中文", "\u2028\u2029", "</script>"]
REQUEST_IDS = ["chatcmpl-1", 'id-with-"quote"', "ü-id"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("request_id", REQUEST_IDS)
@pytest.mark.parametrize("token_ids, usage", [(None, None), ([1, 2, 151645], None), (None, (7, 3, 2)),
                                              ([5], (1, 1, 0))])
def test_a_chat_text_chunk_spells_what_the_model_spells(text, request_id, token_ids, usage):
    head = ChunkHead(request_id, "chat.completion.chunk", 1765000000, 'model "q" ü')
    frame = head.chat_text(3, text, token_ids, usage_json(*usage) if usage else None)
    model = ChatCompletionChunk(id=request_id, created=1765000000, model='model "q" ü',
                                choices=[StreamChoice(index=3, delta=DeltaMessage(content=text), token_ids=token_ids)],
                                usage=Usage.of(*usage) if usage else None)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[len(b"data: "):]) == json.loads(model.model_dump_json())


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("usage", [None, (9, 4, 1)])
def test_a_text_completion_chunk_spells_what_the_model_spells(text, usage):
    head = ChunkHead("cmpl-7", "text_completion", 1765000000, "m")
    frame = head.completion_text(text, usage_json(*usage) if usage else None)
    model = CompletionResponse(id="cmpl-7", created=1765000000, model="m", choices=[CompletionChoice(text=text)],
                               usage=Usage.of(*usage) if usage else None)
    assert json.loads(frame[len(b"data: "):]) == json.loads(model.model_dump_json())
