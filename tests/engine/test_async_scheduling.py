"""Async scheduling (``EngineConfig.async_scheduling``): each step is launched before the last one's
tokens reach the host, its inputs that are those tokens filled in on the device. Whatever the steps'
overlap, the answers are those of the engine that steps in order: token for token under greedy and
seeded sampling, with logprobs, stop tokens, max_tokens, requests admitted mid-run, preemption by
recompute, prefix-cache hits on blocks whose last token was in flight, and KV imported from another
worker; an aborted request keeps a prefix of its answer and every block comes back."""
from __future__ import annotations

import torch

from epd.config import EngineConfig
from epd.engine.llm_engine import LLMEngine
from epd.types import SamplingParams

BLOCK = 16


def _engine(model, overlap: bool, **config) -> LLMEngine:
    options = {"device": "cpu", "num_kv_blocks": 64, "block_size": BLOCK, "max_num_seqs": 4,
               "max_num_batched_tokens": 64, **config}
    return LLMEngine(model, EngineConfig(async_scheduling=overlap, **options), eos_token_ids=())


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(10, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _answers(engine: LLMEngine, requests) -> list[tuple[list[int], str | None]]:
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    engine.run_until_done(seqs)
    _drain(engine)
    return [(seq.output_token_ids, seq.finish_reason) for seq in seqs]


def _drain(engine: LLMEngine) -> None:
    """The last step launched (its rows all finished already) is still in flight: one more step
    takes its tokens, drops them, and leaves nothing."""
    for _ in range(2):
        if engine.has_unfinished:
            assert engine.step() == []
    assert not engine.has_unfinished


def _greedy(max_tokens: int, **params) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)


def test_greedy_answers_equal_the_in_order_engine_with_requests_admitted_mid_run(model):
    # 7 requests, 4 at a time: some are admitted while others' tokens are in flight
    requests = [(_prompt(i, 9 + 7 * i), _greedy(5 + 6 * i)) for i in range(7)]
    in_order = _answers(_engine(model, False), requests)
    engine = _engine(model, True)
    assert _answers(engine, requests) == in_order
    assert engine.num_overlapped_steps > 20  # it did overlap: most steps launched with tokens in flight
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_a_stop_token_ends_the_answer_at_the_same_token(model):
    prompt = _prompt(40, 20)
    (reference, _), = _answers(_engine(model, False), [(prompt, _greedy(24))])
    stop = reference[7]  # a token the answer reaches mid-way (the first time it appears)
    requests = [(prompt, _greedy(24, stop_token_ids=(stop,))), (_prompt(41, 30), _greedy(24))]
    in_order = _answers(_engine(model, False), requests)
    assert in_order[0] == (reference[:reference.index(stop) + 1], "stop")
    assert _answers(_engine(model, True), requests) == in_order


def test_rows_that_need_the_host_sample_there_and_answer_the_same(model):
    """Logprobs, a seeded draw and a penalty need the host: such steps sample in order; the greedy
    rows beside them and the seeded row's own draws are the same as without overlap."""
    requests = [(_prompt(50, 12), _greedy(10)),
                (_prompt(51, 14), SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)),
                (_prompt(52, 16), _greedy(10, logprobs=2)),
                (_prompt(53, 18), _greedy(10, repetition_penalty=1.3))]
    engines = _engine(model, False), _engine(model, True)
    results = []
    for engine in engines:
        seqs = [engine.add_request(prompt, params) for prompt, params in requests]
        engine.run_until_done(seqs)
        results.append([(s.output_token_ids, [(lp.token_id, round(lp.logprob, 4)) for lp in s.output_logprobs])
                        for s in seqs])
    assert results[1] == results[0]
    # greedy alone overlaps again once the others have ended
    assert _answers(engines[1], requests[:1]) == _answers(engines[0], requests[:1])
    assert engines[1].num_overlapped_steps > 0


def test_preemption_by_recompute_answers_the_same(model):
    """A cache too small for every request's whole answer: requests are preempted (some with a token
    in flight) and recomputed; the answers do not change."""
    requests = [(_prompt(60 + i, 30), _greedy(40)) for i in range(4)]
    preempted = []
    answers = []
    for overlap in (False, True):
        engine = _engine(model, overlap, num_kv_blocks=10)
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq, out, preempt=preempt: (preempted.append(overlap), preempt(seq, out))
        answers.append(_answers(engine, requests))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert answers[1] == answers[0]
    assert preempted.count(True) > 0 and preempted.count(False) > 0


def test_a_prefix_hit_on_blocks_computed_with_a_token_in_flight_answers_the_same(model):
    """The blocks a request fills while its tokens are in flight are published to the prefix cache
    once their tokens are known, with those tokens: a later request that extends the answer reuses
    them and answers as without overlap."""
    prompt = _prompt(70, 2 * BLOCK - 3)
    results = []
    for overlap in (False, True):
        engine = _engine(model, overlap)
        (first, _), = _answers(engine, [(prompt, _greedy(2 * BLOCK + 1))])  # no block boundary after 48
        hits_before = engine.block_manager.num_prefix_hit_tokens
        results.append(_answers(engine, [(prompt + first[:2 * BLOCK], _greedy(12))]))
        assert engine.block_manager.num_prefix_hit_tokens - hits_before == 3 * BLOCK  # blocks 1-2: answer tokens
    assert results[1] == results[0]


def test_imported_kv_decodes_the_same(model):
    """A decode worker's path: the prompt's KV and first token made elsewhere (here: an in-order
    engine's prefill), decoded with overlap."""
    prompt = _prompt(80, 25)
    prefill = _engine(model, False, enable_prefix_caching=False)
    kept = []
    prefill.scheduler.on_finish = lambda s: kept.append(prefill.runner.read_kv(s.block_table, len(prompt)))
    seq = prefill.add_request(prompt, _greedy(1))
    prefill.run_until_done([seq])
    first = seq.output_token_ids[0]
    answers = []
    for overlap in (False, True):
        engine = _engine(model, overlap)
        imported = engine.add_imported(prompt, _greedy(20), first_token_id=first, first_logprobs=None,
                                       kv=kept[0].clone(), mm=None, eos_token_ids=())
        engine.run_until_done([imported])
        answers.append(imported.output_token_ids)
    assert answers[1] == answers[0] == _answers(_engine(model, False), [(prompt, _greedy(20))])[0][0]


def test_an_abort_keeps_a_prefix_of_the_answer_and_frees_everything(model):
    requests = [(_prompt(90 + i, 20), _greedy(30)) for i in range(3)]
    in_order = _answers(_engine(model, False), requests)
    engine = _engine(model, True)
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    for _ in range(8):
        engine.step()
    engine.abort(seqs[1])
    engine.run_until_done(seqs)
    _drain(engine)
    assert seqs[1].finish_reason == "abort"
    aborted = seqs[1].output_token_ids
    assert 0 < len(aborted) < 30 and aborted == in_order[1][0][:len(aborted)]
    assert [(s.output_token_ids, s.finish_reason) for s in (seqs[0], seqs[2])] == [in_order[0], in_order[2]]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks

