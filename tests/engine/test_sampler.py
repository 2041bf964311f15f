import pytest
import torch

from epd.engine.sampler import Sampler, _keep_top_k, _keep_top_p
from epd.engine.sequence import Sequence
from epd.types import SamplingParams


def seq(**params):
    return Sequence([1, 2, 3], SamplingParams(max_tokens=8, **params))


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    assert Sampler()(logits, [seq()])[0][0] == 1


def test_top_k_keeps_exactly_k_candidates():
    kept = _keep_top_k(torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0]), 2)
    assert torch.isfinite(kept).tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(_keep_top_p(logits, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(_keep_top_p(logits, 0.1)).tolist() == [True, False, False, False]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    a = [Sampler()(logits[:1], [seq(temperature=1.0, seed=7)])[0][0] for _ in range(3)]
    assert len(set(a)) == 1
    sampler = Sampler()
    batch = sampler(logits[[0, 1, 2]], [seq(temperature=1.0, seed=7), seq(temperature=1.0, seed=8),
                                        seq(temperature=1.0)])
    assert batch[0][0] == a[0]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler()
    s = Sequence([1], SamplingParams(max_tokens=4000, temperature=1.0, seed=1))
    draws = []
    for _ in range(2000):
        draws.append(sampler(logits, [s])[0][0])
        s.append_token(draws[-1])  # the next draw uses the next per-token seed
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


def test_a_mixed_batch_samples_each_row_by_its_own_params():
    """Greedy and plain-temperature rows are sampled batched, the rest row by row: every row still
    follows its own parameters, wherever it sits in the batch."""
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).repeat(6, 1)
    logits[1] = torch.tensor([0.0, 0.0, 5.0])  # a greedy row whose argmax differs from the others
    params = [dict(), dict(), dict(temperature=1.0), dict(temperature=0.05), dict(temperature=1.0, top_k=1),
              dict(temperature=1.0, seed=3)]
    sampler = Sampler()
    draws = [[tok for tok, _ in sampler(logits, [seq(**p) for p in params])] for _ in range(3000)]
    columns = list(zip(*draws))
    assert set(columns[0]) == {0} and set(columns[1]) == {2} and set(columns[4]) == {0}
    assert [columns[2].count(t) / 3000 for t in range(3)] == pytest.approx([0.6, 0.3, 0.1], abs=0.04)
    assert columns[3].count(0) / 3000 > 0.99  # temperature 0.05: nearly always the mode
    assert len(set(columns[5])) == 1  # seeded: the same draw for the same token position


def test_the_two_level_draw_follows_the_distribution_and_never_draws_a_zero_weight():
    """Wide rows are drawn block by block (64 columns): mass at block edges, in the last (padded)
    block and far apart lands where it should, and a zero-weight column is never drawn."""
    from epd.engine.sampler import draw

    torch.manual_seed(0)
    weights = {0: 0.3, 63: 0.2, 64: 0.1, 500: 0.25, 999: 0.15}  # 1,000 columns: not a multiple of 64
    probs = torch.zeros(1000)
    probs[list(weights)] = torch.tensor(list(weights.values()))
    drawn = draw(probs.repeat(20_000, 1) * 3.0).tolist()  # any scale: the draw is by each row's total
    assert set(drawn) <= set(weights)
    assert {t: drawn.count(t) / len(drawn) for t in weights} == pytest.approx(weights, abs=0.015)
    dense = torch.softmax(torch.randn(300) * 2, dim=-1)  # every column weighted
    counts = torch.bincount(draw(dense.repeat(50_000, 1)), minlength=300) / 50_000
    assert 0.5 * (counts - dense).abs().sum() < 0.05  # total variation: sampling noise is ~0.03
    broken = torch.stack([torch.full((1000,), float("nan")), torch.zeros(1000)])  # NaN logits, no weight
    assert all(0 <= t < 1000 for t in draw(broken).tolist())  # a column of the row, never the padding


def test_logprobs_are_of_the_raw_distribution_with_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    token, lp = Sampler()(logits, [seq(temperature=0.5, seed=3, logprobs=2)])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert lp.token_id == token and lp.logprob == pytest.approx(float(ref[token]))
    assert list(lp.top) == [0, 1] and lp.top[0] == pytest.approx(float(ref[0]))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=0), dict(max_tokens=0),
                                 dict(logprobs=21)])
def test_invalid_sampling_params_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.mark.parametrize("vocab", [50, 1000])
def test_batched_top_k_top_p_is_the_row_by_row_distribution(vocab):
    from epd.engine.sampler import filtered_probs
    torch.manual_seed(1)
    logits = torch.randn(5, vocab) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.6),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.8), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.9, top_p=0.01)]
    probs, candidates = filtered_probs(params, logits)
    for row, p in enumerate(params):
        scaled = logits[row] / p.temperature
        if p.top_k > 0:
            scaled = _keep_top_k(scaled, p.top_k)
        if p.top_p < 1.0:
            scaled = _keep_top_p(scaled, p.top_p)
        expected = torch.softmax(scaled, dim=-1)
        got = torch.zeros(vocab).index_add_(0, candidates[row], probs[row])
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_top_k_rows_sampled_in_a_batch_follow_their_distribution():
    torch.manual_seed(2)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    seqs = [seq(temperature=1.0, top_k=2) for _ in range(4000)]
    draws = [token for token, _ in Sampler()(logits, seqs)]
    assert set(draws) <= {0, 1}
    assert draws.count(0) / len(draws) == pytest.approx(0.5 / 0.8, abs=0.03)


def test_greedy_tokens_take_the_first_maximum_like_argmax():
    from epd.engine.sampler import greedy_tokens
    logits = torch.randn(8, 1000)
    logits[3, 10] = logits[3, 500] = 99.0  # a tie: the first wins, as in transformers' greedy search
    logits[5] = 0.0  # all equal
    logits[6, 7] = float("nan")  # NaN counts as the maximum, as argmax has it
    for x in (logits, logits.bfloat16(), logits.t().contiguous().t()):  # the numpy path and the torch one
        assert greedy_tokens(x).tolist() == x.argmax(dim=-1).tolist()
    assert greedy_tokens(logits)[3].item() == 10 and greedy_tokens(logits)[5].item() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or __import__("importlib").util.find_spec("flashinfer") is None,
                    reason="needs CUDA and FlashInfer")
def test_flashinfers_sampling_kernels_honour_temperature_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(6, 50_000, device="cuda") * 4
    cases = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6),
             SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.5, top_k=5, top_p=0.5),
             SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    seqs = [Sequence([1], p) for p in cases]
    for _ in range(20):
        out = [token for token, _ in Sampler()(logits, seqs)]
        best = logits.argmax(dim=-1).tolist()
        top5 = logits.topk(5).indices.tolist()
        assert out[0] == best[0] and out[1] == best[1] and out[5] == best[5]  # top-1, a tiny top-p, greedy
        assert out[2] in top5[2] and out[3] in top5[3]
        assert 0 <= out[4] < 50_000


def test_sample_rows_kept_and_joined_are_what_sorting_the_rows_again_gives():
    """A batch kept from step to step renumbers its rows when sequences leave and join, without
    reading every sequence again: the groups must be those a fresh sort would make."""
    import numpy as np

    from epd.engine.sampler import SampleRows
    kinds = [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, temperature=0.5),
             SamplingParams(max_tokens=5, temperature=0.5, top_k=3), SamplingParams(max_tokens=5, logprobs=1),
             SamplingParams(max_tokens=5, repetition_penalty=1.2), SamplingParams(max_tokens=5, seed=3, temperature=1.0)]
    seqs = [Sequence([1, 2], kinds[i % 6]) for i in range(20)]
    rows = SampleRows(seqs)
    keep = np.array([i % 3 != 1 for i in range(20)])
    assert vars(rows.kept(keep)) == vars(SampleRows([s for s, k in zip(seqs, keep) if k]))
    assert vars(rows.kept(np.zeros(20, dtype=bool))) == vars(SampleRows([]))
    assert vars(rows.joined(seqs[:7])) == vars(SampleRows(seqs + seqs[:7]))
    assert vars(SampleRows([]).joined(seqs[:3])) == vars(SampleRows(seqs[:3]))
