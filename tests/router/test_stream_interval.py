"""``--stream-interval N``: after its first token, a request's tokens reach its client in groups of
N, the last group when it finishes; the tokens, text, stop and usage are those of a stream of one
token at a time. In-process: the grouping itself, and the router's real pipeline behind both front
ends (the official openai client over HTTP, the SDK over gRPC) on a scripted backend."""
from __future__ import annotations

import openai
import pytest

from epd.config import ConfigError, RouterConfig, load_config
from epd.router.backends.base import BackendOutput
from epd.router.token_groups import TokenGroups
from epd.types import TokenLogprobs
from tests.router.fake_backend import ScriptedBackend
from tests.router.test_pipeline import both_front_ends, make_pipeline, model_dir, tokenizer  # noqa: F401 - fixtures


def test_a_group_is_the_first_token_alone_then_every_n_then_what_the_finish_leaves():
    groups = TokenGroups(4)
    out = [groups.take(BackendOutput([1], num_cached_tokens=7), first=True)]
    assert out[0].token_ids == [1] and out[0].num_cached_tokens == 7  # the first is never held
    lp = [TokenLogprobs(t, -0.1 * t, {}) for t in range(2, 12)]
    for i, token in enumerate(range(2, 11)):
        out.append(groups.take(BackendOutput([token], [lp[i]]), first=False))
    # a lagging reader's several tokens in one output count as several
    out.append(groups.take(BackendOutput([11, 12], [lp[9]], finish_reason="length"), first=False))
    sent = [o for o in out if o is not None]
    assert [o.token_ids for o in sent] == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12]]
    assert [o.finish_reason for o in sent] == [None, None, None, "length"]
    assert [lp.token_id for lp in sent[1].logprobs] == [2, 3, 4, 5] and sent[1].num_cached_tokens == 0
    assert groups.flush() is None  # nothing left held
    held = TokenGroups(3)
    assert held.take(BackendOutput([5]), first=False) is None
    assert held.flush().token_ids == [5]  # the outputs ended without a finish: what was held goes
    one = BackendOutput([9])
    assert TokenGroups(1).take(one, first=False) is one  # 1: every output as it comes


def test_an_interval_below_one_is_refused_naming_it():
    with pytest.raises(ConfigError, match="stream_interval"):
        load_config(RouterConfig, {"stream_interval": 0}, source="command line")


def test_both_front_ends_get_groups_with_the_same_tokens_text_stop_and_usage(model_dir, tokenizer):  # noqa: F811
    text = "One two three four five six seven eight nine ten eleven twelve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 11
    outputs = [[t] for t in ids]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Count"}]}
    runs = {}
    for interval in (1, 4):
        backend = ScriptedBackend(outputs, finish_reason="length")
        with both_front_ends(make_pipeline(model_dir, backend, stream_interval=interval)) as (http, sdk):
            chunks = list(http.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
            deltas = list(sdk.stream("Count"))
            # a stop string inside a group ends the answer at the token that completed it
            stopped = http.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True},
                                                   stop=[" six"])
            stopped = list(stopped)
        runs[interval] = (chunks, deltas, stopped)
    for interval, (chunks, deltas, stopped) in runs.items():
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == len(ids)
        assert [t for d in deltas for t in d.token_ids] == ids and "".join(d.text for d in deltas) == text
        assert "".join(c.choices[0].delta.content or "" for c in stopped if c.choices) == "One two three four five"
    sizes = [len(d.token_ids) for d in runs[4][1] if d.token_ids]
    assert sizes[0] == 1 and all(n == 4 for n in sizes[1:-1]) and 1 <= sizes[-1] <= 4, sizes
    assert len(sizes) == 1 + -(-(len(ids) - 1) // 4)
    assert [len(d.token_ids) for d in runs[1][1] if d.token_ids] == [1] * len(ids)
    events = {i: sum(1 for c in chunks if c.choices and c.choices[0].delta.content) for i, (chunks, _, _) in
              runs.items()}
    assert events[4] == len(sizes) < events[1]  # one SSE event a group
    usage = {i: stopped[-1].usage.completion_tokens for i, (_, _, stopped) in runs.items()}
    assert usage[1] == usage[4]  # the same tokens counted, however they were grouped


def test_the_official_client_reads_a_grouped_stream_unmodified(model_dir, tokenizer):  # noqa: F811
    ids = tokenizer.encode("a b c d e f g h", add_special_tokens=False)
    backend = ScriptedBackend([[t] for t in ids], finish_reason="stop")
    with both_front_ends(make_pipeline(model_dir, backend, stream_interval=3)) as (http, _):
        answer = http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert isinstance(http, openai.OpenAI)
    assert answer.choices[0].message.content == "a b c d e f g h" and answer.usage.completion_tokens == len(ids)
