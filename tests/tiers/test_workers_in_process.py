"""Prefill and decode workers driven directly (no gRPC, no transport): the hand-off logic alone
must reproduce the in-process engine token for token."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from epd.config import EngineConfig
from epd.decode.worker import DecodeWorker
from epd.errors import InvalidRequest
from epd.llm import LLM
from epd.prefill.worker import PrefillWorker
from epd.types import SamplingParams
from epd.wire.protocol import DecodeJob, PrefillJob, prefill_job_from_proto, request_metadata
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message

pytestmark = pytest.mark.slow
ENGINE = EngineConfig(block_size=4, num_kv_blocks=1024, max_num_batched_tokens=16)
IMAGES = [make_image_bytes(120, 90, seed=11), make_image_bytes(60, 200, seed=12)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen2-vl", engine_config=ENGINE)


@pytest.fixture(scope="module")
def workers(llm):
    prefill, decode = PrefillWorker(llm.model_dir, ENGINE), DecodeWorker(llm.model_dir, ENGINE)
    yield prefill, decode
    prefill.close()
    decode.close()


def run_split(llm, prefill, decode, messages, params, push_delay_s=0.0, request_id="r1", eos=None, finish=None,
              resumed=(), logprobs=None):
    """What the router does, minus gRPC: register at prefill, push the rows (late, from another
    thread, as an encoder would), take the first token and the KV, continue on decode.
    ``resumed``: outputs the request already produced (a migration resumes after them)."""
    conv, images = llm.extract_media(messages)
    prompt = llm.processor.process_messages(conv, images)
    eos = eos or (llm.tokenizer.eos_token_id,)
    job = prefill_job_from_proto(request_metadata(request_id, prompt, params, eos, output_token_ids=resumed))
    rows = llm.vision.encode_images(images) if images else []
    ticket = prefill.admit(job)

    def push():
        time.sleep(push_delay_s)
        for i, r in enumerate(rows):
            assert prefill.push(request_id, i, r)

    pusher = threading.Thread(target=push)
    pusher.start()
    result = prefill.wait(ticket, timeout_s=60)
    pusher.join()
    assert ticket.seq.mm is None or ticket.seq.mm.is_stripped, "prefill must strip its own sequence"
    tokens = [result.first_token_id]
    if logprobs is not None:
        logprobs.append(result.first_logprobs)
    if result.finish_reason is None:
        added, updates = decode.start(DecodeJob(request_id, prompt.prompt_token_ids, params, eos,
                                                result.first_token_id, result.first_logprobs, result.mrope_delta,
                                                tuple(resumed)), result.kv)
        seq = added.result(60)
        assert seq.mm.is_stripped and seq.mm.mrope_delta == result.mrope_delta
        while True:
            update = updates.get(timeout=60)
            tokens += update.token_ids
            if logprobs is not None:
                logprobs += update.logprobs
            if update.is_last:
                if finish is not None:
                    finish.append(update.finish_reason)
                break
    return prompt, tokens


@pytest.mark.parametrize("images", [[], IMAGES[:1], IMAGES], ids=["0img", "1img", "2img"])
def test_split_prefill_decode_equals_in_process(llm, workers, images):
    params = SamplingParams(max_tokens=24)
    messages = user_message("Describe.", images)
    expected = llm.chat(messages, params)[0].token_ids
    _, tokens = run_split(llm, *workers, messages, params)
    assert tokens == expected


def test_seeded_sampling_survives_the_tier_split(llm, workers):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5)
    messages = user_message("A story.", IMAGES[:1])
    expected = llm.chat(messages, params)[0].token_ids
    _, tokens = run_split(llm, *workers, messages, params, request_id="seeded")
    assert tokens == expected


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20),
                                    SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=7, logprobs=2)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_resumed", [1, 6, 19])
def test_a_request_resumed_after_its_outputs_goes_on_as_if_never_moved(llm, workers, params, num_resumed):
    """Migration's engine half: prompt + the outputs so far prefilled anew, then decode; the rest
    of the stream (tokens, logprobs, finish reason) is the uninterrupted one's, whose draws are
    keyed by output index."""
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "And"},
                                             {"type": "image", "image": IMAGES[1]}, {"type": "text", "text": "?"}]}]
    reference = llm.chat(messages, params)[0]
    assert len(reference.token_ids) == 20, "the reference must run to max_tokens to test resuming late"
    finish, logprobs = [], []
    _, tokens = run_split(llm, *workers, messages, params, request_id=f"resumed-{num_resumed}-{params.seed}",
                          resumed=reference.token_ids[:num_resumed], finish=finish, logprobs=logprobs)
    assert tokens == reference.token_ids[num_resumed:]
    if params.logprobs is not None:  # one per new token, the model's own (all-close: batched differently)
        expected = reference.logprobs[num_resumed:]
        assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in expected]
        assert [list(lp.top) for lp in logprobs] == [list(lp.top) for lp in expected]
        torch.testing.assert_close([lp.logprob for lp in logprobs], [lp.logprob for lp in expected],
                                   atol=1e-4, rtol=1e-4)
    assert finish == ([] if num_resumed == 19 else ["length"])  # 19: prefill's token is the last


def test_resuming_with_no_token_left_to_make_is_refused():
    meta = request_metadata("done", _Prompt([1, 2, 3]), SamplingParams(max_tokens=2), (), output_token_ids=[5, 6])
    with pytest.raises(InvalidRequest, match="leave none of max_tokens=2"):
        prefill_job_from_proto(meta)


class _Prompt:
    def __init__(self, ids):
        self.prompt_token_ids, self.items = ids, []


def test_text_before_the_image_is_prefilled_while_the_encoder_works(llm, workers):
    prefill, decode = workers
    params = SamplingParams(max_tokens=4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "An unusual preamble, " * 8},
                                             {"type": "image", "image": IMAGES[0]}]}]
    computed_at_push = []
    original_push = prefill.inbox.push

    def spy(request_id, index, tensor, release=None):
        seq = next(s for s in prefill.engine.scheduler.running if s.request_id == request_id)
        assert seq.num_computed_tokens == seq.mm_items[0].offset  # stopped exactly at the image
        computed_at_push.append((seq.num_computed_tokens - seq.num_cached_tokens, seq.mm_items[0].offset))
        return original_push(request_id, index, tensor, release)

    prefill.inbox.push = spy
    try:
        _, tokens = run_split(llm, prefill, decode, messages, params, push_delay_s=1.0, request_id="slow-enc")
    finally:
        prefill.inbox.push = original_push
    # every token before the image was computed (beyond any prefix-cache hit) before the slowed
    # encoder pushed its rows, and not one past it
    computed, image_offset = computed_at_push[0]
    assert computed > 16
    assert computed <= image_offset
    assert tokens == llm.chat(messages, params)[0].token_ids


def test_decode_stops_at_the_requests_own_end_of_sequence(llm, workers):
    params = SamplingParams(max_tokens=24)
    messages = user_message("Describe.", IMAGES[:1])
    expected = llm.chat(messages, params)[0].token_ids
    # pretend a token that first appears after the prefill's first one ends the sequence for this request
    end = next(t for i, t in enumerate(expected) if i >= 2 and t not in expected[:i])
    finish = []
    _, tokens = run_split(llm, *workers, messages, params, request_id="own-eos", eos=(end,), finish=finish)
    assert tokens == expected[:expected.index(end) + 1] and finish == ["stop"]


def test_a_prompt_prefill_can_never_hold_is_refused_at_once(workers):
    prefill, _ = workers
    ticket = prefill.admit(PrefillJob("too-long", [1] * (ENGINE.max_model_len + 1), [], SamplingParams(), ()))
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="exceeds max_model_len"):
        prefill.wait(ticket, timeout_s=60)
    assert time.monotonic() - start < 10


def test_a_kv_of_another_shape_is_refused_for_that_request_only(llm, workers):
    _, decode = workers
    job = DecodeJob("bad-kv", [1, 2, 3], SamplingParams(max_tokens=4), (), 5, None, 0)
    added, _ = decode.start(job, torch.zeros(1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match="imported KV has shape"):
        added.result(30)
    # the worker is fine: the next request still runs
    _, tokens = run_split(llm, *workers, user_message("Hi.", []), SamplingParams(max_tokens=4), request_id="after")
    assert len(tokens) == 4
