"""The logits processors against transformers' own (repetition penalty, min-p, sequence bias) and
against OpenAI's definition (presence and frequency penalties), on random logits; rows that ask
for nothing are left as they were (not even copied)."""
from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from epd.engine.logits_processors import apply_logits_processors, keep_min_p
from epd.engine.sequence import Sequence
from epd.types import SamplingParams

VOCAB = 500


def _seq(prompt: list[int], output: list[int], **params) -> Sequence:
    return Sequence(prompt, SamplingParams(max_tokens=64, **params), output_token_ids=output)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    prompt, output = [3, 9, 9, 41], [41, 7, 250]
    ours = apply_logits_processors(logits, [_seq(prompt, output, repetition_penalty=penalty)])
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_logit_bias_equals_transformers_sequence_bias():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    bias = ((5, 100.0), (17, -100.0), (300, 2.5))
    ours = apply_logits_processors(logits, [_seq([1, 2], [], logit_bias=bias)])
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([[1, 2]]), logits.clone())
    torch.testing.assert_close(ours, theirs)
    assert ours.argmax().item() == 5


def test_min_p_keeps_what_transformers_keeps():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB) * 2
    for min_p in (0.05, 0.3, 0.9):
        kept = keep_min_p(torch.softmax(logits, dim=-1), torch.full((3,), min_p)) > 0
        theirs = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(torch.zeros(3, 1, dtype=torch.long), logits.clone())
        assert torch.equal(kept, theirs > float("-inf")), min_p


def test_presence_and_frequency_penalties_are_openais_formula():
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    output = [7, 7, 7, 12, 99]
    ours = apply_logits_processors(logits, [_seq([7, 12, 400], output, presence_penalty=0.5, frequency_penalty=0.25)])
    expected = logits.clone()
    for token, count in {7: 3, 12: 1, 99: 1}.items():  # only output tokens count, not the prompt's 400
        expected[0, token] -= 0.25 * count + 0.5
    torch.testing.assert_close(ours, expected)


def test_rows_without_processors_are_untouched_and_the_batch_is_not_copied_for_nothing():
    logits = torch.randn(3, VOCAB)
    plain = [_seq([1], []), _seq([2], [])]
    same = logits[:2]
    assert apply_logits_processors(same, plain) is same
    mixed = apply_logits_processors(logits, [_seq([1], []), _seq([2], [3], frequency_penalty=1.0), _seq([4], [])])
    assert torch.equal(mixed[0], logits[0]) and torch.equal(mixed[2], logits[2])
    assert mixed[1, 3] == logits[1, 3] - 1.0


def test_a_logit_bias_outside_the_vocabulary_is_refused_when_the_request_arrives():
    """At admission, so that it fails alone: raised in a step, it would fail the whole batch."""
    from epd.config import EngineConfig
    from epd.engine.llm_engine import LLMEngine
    from epd.errors import InvalidRequest
    from epd.models.locate import resolve_model
    from epd.models.registry import load_llm_for
    config = EngineConfig(device="cpu", num_kv_blocks=16)
    engine = LLMEngine(load_llm_for(resolve_model("tiny-qwen2-vl"), config), config, eos_token_ids=())
    vocab = engine.runner.model.config.vocab_size
    with pytest.raises(InvalidRequest, match=f"logit_bias names token {vocab}; the model's vocabulary has {vocab}"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias=((vocab, 1.0),)))
    assert not engine.has_unfinished
