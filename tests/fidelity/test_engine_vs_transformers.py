"""Greedy output of our engine == transformers' generate, token for token (fp32), for Qwen2-VL
(tied embeddings), Qwen2.5-VL (untied, window attention in the vision tower) and Qwen3-VL (q/k
norms, interleaved M-RoPE, deepstack levels added after the first layers)."""
from __future__ import annotations

import pytest

from epd.config import EngineConfig
from epd.llm import LLM
from epd.models.presets import write_preset_checkpoint
from epd.types import SamplingParams
from tests.conftest import make_image_bytes
from tests.fidelity.reference import ReferenceModel, user_message

pytestmark = pytest.mark.slow

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW)
IMG_A = make_image_bytes(333, 517, seed=1)
IMG_B = make_image_bytes(200, 90, seed=2)
IMG_TINY = make_image_bytes(13, 21, seed=3)


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def model_dir(request, tmp_path_factory):
    # a checkpoint the test writes itself, with a seed no preset uses
    return write_preset_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=1234)


@pytest.fixture(scope="module")
def reference(model_dir):
    return ReferenceModel(model_dir)


def make_llm(model_dir, **engine) -> LLM:
    cfg = dict(block_size=4, num_kv_blocks=2048, max_num_batched_tokens=4096)
    return LLM(str(model_dir), engine_config=EngineConfig(**{**cfg, **engine}))


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


def check_same(ref, out):
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.token_ids == ref.token_ids
    assert len(out.token_ids) == MAX_NEW or out.finish_reason == "stop"


@pytest.mark.parametrize("images", [[], [IMG_A], [IMG_A, IMG_B, IMG_TINY]], ids=["0img", "1img", "3img"])
def test_greedy_matches_transformers(llm, reference, images):
    messages = user_message("Describe what you see in detail.", images)
    out = llm.chat(messages, GREEDY)[0]
    check_same(reference.generate(messages, images), out)
    assert len(set(out.token_ids)) > 4, "degenerate model output makes the comparison meaningless"


@pytest.mark.parametrize("kwargs", [{"max_pixels": 224 * 224}, {"min_pixels": 320 * 320, "max_pixels": 400 * 400}],
                         ids=["smaller", "larger-min"])
def test_processor_kwargs_give_transformers_tokens_with_the_same_kwargs(llm, reference, kwargs):
    """vLLM's mm_processor_kwargs: the image processor's pixel bounds for this request only."""
    images = [IMG_A, IMG_TINY]
    messages = user_message("Describe what you see in detail.", images)
    out = llm.chat(messages, GREEDY, mm_processor_kwargs=kwargs)[0]
    assert len(out.prompt_token_ids) != len(llm.chat(messages, GREEDY)[0].prompt_token_ids)  # other geometry
    check_same(reference.generate(messages, images, processor_kwargs=kwargs), out)


def test_processor_kwargs_outside_the_checkpoint_bounds_are_refused(llm):
    from epd.errors import InvalidRequest

    messages = user_message("Hi.", [IMG_B])
    for bad, said in [({"max_pixels": 10**9}, "checkpoint's max_pixels"), ({"num_frames": 2}, "unsupported"),
                      ({"min_pixels": 40_000, "max_pixels": 30_000}, "min_pixels <= max_pixels"),
                      ({"max_pixels": 5e4}, "whole number")]:
        with pytest.raises(InvalidRequest, match=said):
            llm.chat(messages, GREEDY, mm_processor_kwargs=bad)


@pytest.mark.parametrize("chunk_tokens", [7, 13])
def test_chunked_prefill_cutting_through_images(model_dir, reference, chunk_tokens):
    images = [IMG_B, IMG_A]
    messages = user_message("Compare the two pictures.", images)
    llm = make_llm(model_dir, max_num_batched_tokens=chunk_tokens)
    seq = llm.add_conversation(messages, GREEDY)
    spans = [(i.offset, i.offset + i.length) for i in seq.mm_items]
    assert any(lo < k * chunk_tokens < hi for lo, hi in spans for k in range(1, 200)), "no chunk cut an image"
    llm.engine.run_until_done([seq])
    check_same(reference.generate(messages, images), llm._output(seq))


def test_prefix_cache_hit_gives_the_same_tokens(model_dir, reference):
    llm = make_llm(model_dir)
    messages = user_message("What colour dominates?", [IMG_A])
    first = llm.add_conversation(messages, GREEDY)
    llm.engine.run_until_done([first])
    second = llm.add_conversation(messages, GREEDY)
    llm.engine.run_until_done([second])
    block = llm.engine_config.block_size
    # every full block but the one holding the last prompt token comes from the cache
    assert second.num_cached_tokens == (second.num_prompt_tokens - 1) // block * block > 0
    ref = reference.generate(messages, [IMG_A])
    check_same(ref, llm._output(first))
    check_same(ref, llm._output(second))
    # same text, other image behind the same placeholder ids: run it, so the prefix cache is really
    # asked; the image's blocks must not be served from the first image's KV
    same_size = make_image_bytes(333, 517, seed=11)  # IMG_A's size: identical ids, other pixels
    other_messages = user_message("What colour dominates?", [same_size])
    other = llm.add_conversation(other_messages, GREEDY)
    llm.engine.run_until_done([other])
    assert other.token_ids[:other.num_prompt_tokens] == second.token_ids[:second.num_prompt_tokens]
    assert 0 < other.num_cached_tokens <= other.mm_items[0].offset
    check_same(reference.generate(other_messages, [same_size]), llm._output(other))


def test_eight_concurrent_requests_each_match_their_solo_run(llm, reference):
    cases = [("Hi.", []), ("Tell me a long story about a lighthouse keeper and the sea.", []),
             ("What is this?", [IMG_TINY]), ("Describe.", [IMG_A]), ("Two images:", [IMG_A, IMG_B]),
             ("Count the shapes in the picture please.", [IMG_B]), ("一张图片", [IMG_TINY, IMG_A]),
             ("def f(x): return x * 2  # explain", [])]
    conversations = [user_message(text, imgs) for text, imgs in cases]
    batch = llm.chat(conversations, GREEDY)
    for (text, imgs), conv, out in zip(cases, conversations, batch):
        check_same(reference.generate(conv, imgs), out)


def test_logprobs_match_transformers(llm, reference):
    messages = user_message("Name three animals.", [IMG_B])
    out = llm.chat(messages, SamplingParams(max_tokens=MAX_NEW, logprobs=5))[0]
    ref = reference.generate(messages, [IMG_B])
    check_same(ref, out)
    for step, (ours, theirs) in enumerate(zip(out.logprobs, ref.logprobs)):
        assert abs(ours.logprob - float(theirs[ours.token_id])) < 1e-4, f"step {step}"
        top_ids = theirs.topk(5).indices.tolist()
        assert list(ours.top) == top_ids, f"step {step}: top-5 differ"
        for tok, lp in ours.top.items():
            assert abs(lp - float(theirs[tok])) < 1e-4


def test_prompts_are_stripped_once_done_and_a_preempted_one_re_encodes(model_dir, reference):
    """After its prompt is computed a sequence keeps only the M-RoPE delta; if it is preempted
    later it must recompute the prompt, so its images are encoded again (the rows are gone)."""
    cases = [("Describe the picture in detail.", [IMG_B]), ("What colour dominates here?", [IMG_B])]
    conversations = [user_message(text, imgs) for text, imgs in cases]
    probe = make_llm(model_dir)
    prompt_lens = [len(probe.processor.process_messages(*probe.extract_media(c)).prompt_token_ids)
                   for c in conversations]
    block = 4
    # both prompts and one request's output fit, both outputs do not: the newest is preempted
    llm = make_llm(model_dir, block_size=block, num_kv_blocks=(sum(prompt_lens) + MAX_NEW) // block + 2)
    encodes = []
    encode = llm._encode
    llm._encode = lambda prompt: encodes.append(len(prompt.items)) or encode(prompt)
    seqs = [llm.add_conversation(c, GREEDY) for c in conversations]
    stripped_after_first_token = []
    while not all(s.is_finished for s in seqs):
        llm.engine.step()
        stripped_after_first_token += [s.mm.is_stripped for s in seqs if s.num_output_tokens == 1]
    assert stripped_after_first_token and all(stripped_after_first_token)
    assert len(encodes) > len(seqs), "no request was preempted after its prompt: the KV budget is too large"
    for (text, imgs), conv, seq in zip(cases, conversations, seqs):
        check_same(reference.generate(conv, imgs), llm._output(seq))


def test_the_flex_backend_reads_the_paged_cache_to_the_same_tokens(model_dir, reference):
    """flex_attention over the paged cache in place: chunked prefill cutting through images, steps
    that mix decodes with prefill chunks, and a prefix hit, all token-identical to transformers."""
    llm = make_llm(model_dir, attention_backend="flex", max_num_batched_tokens=13)
    assert llm.engine.runner.attention_backend == "flex"
    cases = [("Compare the two pictures.", [IMG_B, IMG_A]), ("Describe.", [IMG_A]), ("Hi.", [])]
    conversations = [user_message(text, imgs) for text, imgs in cases]
    for (text, imgs), conv, out in zip(cases, conversations, llm.chat(conversations, GREEDY)):
        check_same(reference.generate(conv, imgs), out)
    again = llm.add_conversation(conversations[1], GREEDY)
    llm.engine.run_until_done([again])
    assert again.num_cached_tokens > 0
    check_same(reference.generate(conversations[1], [IMG_A]), llm._output(again))


@pytest.mark.parametrize("processor", ["repetition_penalty", "logit_bias"])
def test_logits_processors_give_transformers_greedy_tokens(llm, reference, processor):
    """Greedy with a processor that must change this output (a penalty below 1 pulls seen tokens
    up; a bias of -100 bans the first greedy token), token-identical to transformers' own."""
    messages = user_message("Describe what you see in detail.", [IMG_A, IMG_B])
    plain = llm.chat(messages, GREEDY)[0].token_ids
    if processor == "repetition_penalty":
        ours, theirs = dict(repetition_penalty=0.5), dict(repetition_penalty=0.5)
    else:
        bias = {plain[0]: -100.0, 11: 3.0}
        ours = dict(logit_bias=tuple(sorted(bias.items())))
        theirs = dict(sequence_bias={(t,): b for t, b in bias.items()})
    out = llm.chat(messages, SamplingParams(max_tokens=MAX_NEW, **ours))[0]
    check_same(reference.generate(messages, [IMG_A, IMG_B], **theirs), out)
    assert out.token_ids != plain
