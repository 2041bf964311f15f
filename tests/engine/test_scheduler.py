import pytest

from epd.engine.block_manager import BlockManager
from epd.engine.scheduler import Scheduler, SchedulerConfig
from epd.engine.sequence import Sequence
from epd.types import SamplingParams


def make(num_blocks=64, block_size=4, budget=8, max_seqs=8, max_len=256):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len), bm)


def seq(n, max_tokens=4):
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(sched, token=42):
    out = sched.schedule()
    sampled = {c.seq.seq_id: (token, None) for c in out.chunks if c.samples}
    return out, sched.update(out, sampled)


def test_long_prompt_is_chunked_by_the_token_budget():
    sched = make(budget=8)
    s = seq(20)
    sched.add(s)
    sizes = []
    while s.num_output_tokens == 0:
        out, _ = run_step(sched)
        sizes.append([(c.start, c.num_tokens) for c in out.chunks])
    assert sizes == [[(0, 8)], [(8, 8)], [(16, 4)]]


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make(budget=6)
    a = seq(3)
    sched.add(a)
    run_step(sched)  # a prefilled and sampled once
    b = seq(20)
    sched.add(b)
    out, _ = run_step(sched)
    assert out.chunks[0].seq is a and out.chunks[0].num_tokens == 1
    assert out.chunks[1].seq is b and out.chunks[1].num_tokens == 5


def test_finished_sequences_release_their_blocks():
    sched = make(num_blocks=8)
    s = seq(5, max_tokens=3)
    sched.add(s)
    finished = []
    for _ in range(10):
        finished += run_step(sched)[1]
        if finished:
            break
    assert finished == [s] and s.finish_reason == "length" and s.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == 8


def test_preemption_by_recompute_when_blocks_run_out():
    # 4 blocks of 2 slots: two sequences of 3 prompt tokens grow until one must yield
    sched = make(num_blocks=4, block_size=2, budget=16)
    a, b = seq(3, max_tokens=4), seq(3, max_tokens=4)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(40):
        out, _ = run_step(sched)
        preempted += out.preempted
        if a.is_finished and b.is_finished:
            break
    assert a.is_finished and b.is_finished
    assert preempted, "expected at least one preemption with this little KV"
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert sched.block_manager.num_free_blocks == 4


def test_request_over_max_model_len_is_rejected_with_numbers():
    sched = make(max_len=10)
    with pytest.raises(ValueError, match=r"prompt \(8 tokens\) \+ max_tokens \(4\) exceeds max_model_len=10"):
        sched.add(seq(8, max_tokens=4))


def test_max_num_seqs_caps_admission():
    sched = make(max_seqs=2, budget=100)
    for _ in range(3):
        sched.add(seq(4))
    out = sched.schedule()
    assert len(out.chunks) == 2 and len(sched.waiting) == 1


def imported(n, max_tokens=4):
    """A decode worker's sequence: prompt computed elsewhere, first token already appended."""
    s = seq(n, max_tokens=max_tokens)
    s.append_token(7)
    s.imported_kv = object()
    return s


def test_imported_sequences_wait_fifo_for_their_whole_budget_then_decode():
    # 6 blocks of 4 slots; each import reserves prompt 8 + 4 tokens = 3 blocks
    sched = make(num_blocks=6, block_size=4, budget=16)
    first, second, third = imported(8), imported(8), imported(2, max_tokens=2)
    for s in (first, second, third):
        sched.add_imported(s, len(s.token_ids) - 1 + s.sampling_params.max_tokens)
    out = sched.schedule()
    assert out.imported == [first, second] and sched.importing == type(sched.importing)([third])
    # each admitted import decodes at once: one token after its computed prompt, no prefill chunk
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(first, 8, 1), (second, 8, 1)]
    for _ in range(10):  # third fits only once one of them finished and freed its blocks
        sched.update(out, {c.seq.seq_id: (5, None) for c in out.chunks})
        out = sched.schedule()
        if third in out.imported:
            break
    assert first.is_finished and second.is_finished and first.num_output_tokens == 4
    assert third in sched.running and third.num_computed_tokens == 2 and [c.seq for c in out.chunks] == [third]


def test_an_import_that_can_never_fit_is_refused_and_an_abort_reaches_the_queue():
    sched = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"20 tokens need 5 KV blocks, the cache has 2 in all"):
        sched.add_imported(imported(16), 20)
    waiting = imported(4)
    sched.add_imported(waiting, 8)
    sched.add_imported(other := imported(4), 8)  # 2 blocks each: the second waits
    sched.schedule()
    sched.abort(other)
    assert not sched.importing and other.is_finished and other.imported_kv is None


class _Unrebuildable:
    """Multimodal state that was stripped and cannot be made again (its re-encode fails)."""

    def restore_for_recompute(self):
        raise RuntimeError("the encoder is gone")


def test_a_preempted_sequence_that_cannot_recompute_fails_alone():
    sched = make(num_blocks=4, block_size=2, budget=16)
    a, b = seq(3, max_tokens=4), seq(3, max_tokens=4)
    b.mm = _Unrebuildable()  # the newest: the one preempted when blocks run out
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        run_step(sched)
        if a.is_finished and b.is_finished:
            break
    assert a.num_output_tokens == 4 and a.error is None
    assert b.finish_reason == "abort" and "could not be recomputed: the encoder is gone" in b.error
    assert sched.block_manager.num_free_blocks == 4
