"""The decode batch kept from step to step (``epd.engine.decode_batch``): decoding sequences are
rows moved on by one each step, prompts are prefilled beside them, imported requests join and
finished ones leave as rows. Its answers are the general step's, token for token, whatever the
requests ask (greedy, seeded and filtered draws, logprobs, penalties, stop tokens, min_tokens,
lengths), across page boundaries, preemption, aborts, the prefix cache and arrivals (images beside
the rows: the fidelity suite against transformers); and a steady batch never goes back through the
per-sequence scheduler and input preparation (the regression guard on what the kept batch is for)."""
from __future__ import annotations

import torch

from epd.config import EngineConfig
from epd.engine.block_tables import BlockTableMirror
from epd.engine.llm_engine import LLMEngine
from epd.engine.scheduler import ScheduledChunk, Scheduler
from epd.types import SamplingParams

BLOCK = 16


def _engine(model, keep: bool, **config) -> LLMEngine:
    options = {"device": "cpu", "num_kv_blocks": 64, "block_size": BLOCK, "max_num_seqs": 8,
               "max_num_batched_tokens": 64, **config}
    engine = LLMEngine(model, EngineConfig(**options), eos_token_ids=(7,))
    engine.keep_decode_batch = keep
    return engine


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(10, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, requests, abort_at: dict[int, int] | None = None):
    """-> each request's (outputs, finish reason, logprobs); ``abort_at``: request index -> the step
    after which it is aborted."""
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    for step in range(1, 500):
        if all(seq.is_finished for seq in seqs):
            break
        engine.step()
        for index, when in (abort_at or {}).items():
            if when == step and not seqs[index].is_finished:
                engine.abort(seqs[index])
    assert all(seq.is_finished for seq in seqs)
    return [(seq.output_token_ids, seq.finish_reason,
             [(lp.token_id, round(lp.logprob, 4), sorted(lp.top)) for lp in seq.output_logprobs if lp is not None])
            for seq in seqs]


def _mixed(greedy_answer: list[int]) -> list[tuple[list[int], SamplingParams]]:
    stop = greedy_answer[5]
    return [
        (_prompt(0, 20), SamplingParams(max_tokens=40, ignore_eos=True)),
        (_prompt(0, 20), SamplingParams(max_tokens=40, stop_token_ids=(stop,))),  # stops at its 6th token
        (_prompt(0, 20), SamplingParams(max_tokens=40, stop_token_ids=(stop,), min_tokens=8)),  # not before 8
        (_prompt(1, 33), SamplingParams(max_tokens=25, temperature=0.8, seed=11, ignore_eos=True)),
        (_prompt(2, 9), SamplingParams(max_tokens=30, temperature=0.7, top_k=20, top_p=0.9, seed=5, ignore_eos=True)),
        (_prompt(3, 17), SamplingParams(max_tokens=35, logprobs=2, ignore_eos=True)),
        (_prompt(4, 40), SamplingParams(max_tokens=45, repetition_penalty=1.3, ignore_eos=True)),
        (_prompt(5, 3), SamplingParams(max_tokens=12)),  # eos (7) may end it
    ]


def test_kept_batch_answers_as_the_general_step_for_every_kind_of_request(model):
    greedy = _run(_engine(model, keep=False), [(_prompt(0, 20), SamplingParams(max_tokens=40, ignore_eos=True))])
    requests = _mixed(greedy[0][0])
    kept_engine = _engine(model, keep=True)
    kept, general = _run(kept_engine, requests), _run(_engine(model, keep=False), requests)
    assert kept == general
    assert kept[1][1] == "stop" and len(kept[1][0]) == 6 and len(kept[2][0]) > 6
    assert kept[5][2] and len(kept[5][2]) == 35  # logprobs rows went through the kept batch too
    # sequences cross pages (16 tokens) during kept steps: most steps ran from the kept batch
    assert kept_engine.num_batch_steps > kept_engine.num_steps // 2


def test_a_steady_batch_skips_the_per_sequence_scheduler_and_input_preparation(model, monkeypatch):
    engine = _engine(model, keep=True, max_num_batched_tokens=128)  # one step prefills every prompt
    seqs = [engine.add_request(_prompt(i, 10 + i), SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(6)]
    for _ in range(3):  # prefill, then the first steady steps
        engine.step()
    # nothing made or looked up per sequence: no chunk, no block-table row lookup, no general schedule
    calls = {"schedule": 0, "__init__": 0, "rows_for": 0}
    for owner, name in ((Scheduler, "schedule"), (ScheduledChunk, "__init__"), (BlockTableMirror, "rows_for")):
        real = getattr(owner, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    before = engine.num_batch_steps
    for _ in range(40):  # crosses two page boundaries for every sequence
        engine.step()
    assert calls == {"schedule": 0, "__init__": 0, "rows_for": 0}
    assert engine.num_batch_steps - before == 40
    assert all(len(seq.output_token_ids) == 43 for seq in seqs)


def test_preemption_and_aborts_leave_the_kept_batch_to_the_general_step(model, monkeypatch):
    """A cache too small for every sequence's growth: a kept step that cannot get a page hands over
    to the general step, which preempts; an abort between steps rebuilds the batch without it.
    Same answers as the general step alone, and every block comes back."""
    preempted = []
    real = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq, out: preempted.append(seq) or real(self, seq, out))
    requests = [(_prompt(10 + i, 20), SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(5)]
    engines = {keep: _engine(model, keep=keep, num_kv_blocks=12) for keep in (True, False)}
    answers = {keep: _run(engine, requests, abort_at={2: 30}) for keep, engine in engines.items()}
    assert answers[True] == answers[False]
    assert preempted and engines[True].num_batch_steps > 0
    assert answers[True][2][1] == "abort" and 0 < len(answers[True][2][0]) < 50
    for engine in engines.values():
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_pages_a_kept_batch_filled_are_found_by_the_prefix_cache(model):
    counts = {}
    for keep in (True, False):
        engine = _engine(model, keep=keep)
        first = engine.add_request(_prompt(20, 10), SamplingParams(max_tokens=50, ignore_eos=True))
        engine.run_until_done([first])
        twin = engine.add_request(list(first.token_ids) + [11], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.run_until_done([twin])
        counts[keep] = (twin.num_cached_tokens, twin.output_token_ids)
    # the last token of the first request was never computed: its full pages before it are cached
    assert counts[True] == counts[False] and counts[True][0] == BLOCK * ((10 + 50 - 1) // BLOCK)


def test_imported_requests_join_the_kept_batch_as_they_arrive(model):
    """A decode worker's load: requests arrive with their prompt's KV computed elsewhere and join
    the running batch between steps; each joins and leaves as a row, no step is the general one,
    and the answers are the general step's."""
    runner_kv = {}

    def arrivals(engine):
        shape = (len(engine.runner.kv_cache.k), 2, 0, engine.runner.num_kv_heads_total,
                 engine.runner.kv_cache.k[0].shape[2])
        for i in range(6):
            n = 12 + 5 * i
            if i not in runner_kv:
                runner_kv[i] = torch.randn((*shape[:2], n, *shape[3:]), generator=torch.Generator().manual_seed(i))
            yield i, _prompt(30 + i, n), runner_kv[i]

    answers, engines = {}, {}
    for keep in (True, False):
        engine = engines[keep] = _engine(model, keep=keep)
        pending, seqs = list(arrivals(engine)), []
        arrive_at = {0: 0, 1: 0, 2: 0, 3: 4, 4: 9, 5: 9}  # request -> the step before which it arrives
        for step in range(200):
            for i, prompt, kv in [p for p in pending if arrive_at[p[0]] == step]:
                seqs.append(engine.add_imported(prompt, SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True),
                                                first_token_id=100 + i, first_logprobs=None, kv=kv, mm=None,
                                                eos_token_ids=(7,)))
            if step > max(arrive_at.values()) and not engine.has_unfinished:
                break
            engine.step()
        answers[keep] = [(seq.output_token_ids, seq.finish_reason) for seq in seqs]
    assert answers[True] == answers[False] and len(answers[True]) == 6
    assert engines[True].num_batch_steps == engines[True].num_steps > 0
    assert engines[False].num_batch_steps == 0
    for engine in engines.values():
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_prompts_arriving_mid_run_are_prefilled_beside_the_kept_rows(model):
    """The in-process engine's load: new prompts (one longer than a step's budget, cut into chunks)
    arrive while others decode; their chunks run in the same steps as the kept rows, they join as
    rows once their prompt is done, and every answer is the general step's."""
    budget = 64
    arrivals = {0: [(_prompt(40, 20), 30), (_prompt(41, 9), 25)],
                3: [(_prompt(42, 150), 20)],  # three chunks beside the rows
                5: [(_prompt(43, 12), 1)],  # done at its first token
                8: [(_prompt(44, 30), 40), (_prompt(45, 5), 35)]}
    answers, engines = {}, {}
    for keep in (True, False):
        engine = engines[keep] = _engine(model, keep=keep, max_num_batched_tokens=budget)
        seqs = []
        for step in range(300):
            for prompt, max_tokens in arrivals.get(step, []):
                seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            if step > max(arrivals) and not engine.has_unfinished:
                break
            engine.step()
        answers[keep] = [(seq.output_token_ids, seq.finish_reason) for seq in seqs]
    assert answers[True] == answers[False]
    assert [len(tokens) for tokens, _ in answers[True]] == [30, 25, 20, 1, 40, 35]
    kept = engines[True]
    # only the first step (nothing decodes yet: no rows) is the general one
    assert kept.num_batch_steps == kept.num_steps - 1, (kept.num_batch_steps, kept.num_steps)
    assert kept.block_manager.num_free_blocks == kept.block_manager.num_total_blocks
