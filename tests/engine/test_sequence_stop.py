"""A sequence's stop check (a quick set lookup for the common step, ``stop_reason`` otherwise)
decides exactly as ``stop_reason`` does, for every combination of the parameters that end a
request: length, min_tokens, stop token ids, EOS and ignore_eos."""
from __future__ import annotations

import itertools

from epd.engine.sequence import Sequence, SequenceStatus, stop_reason
from epd.types import SamplingParams

EOS, STOP, OTHER = 7, 9, 11


def test_check_stop_agrees_with_stop_reason_on_every_case():
    cases = itertools.product((1, 3, 5), (0, 2, 4), ((), (STOP,)), (False, True), (EOS, STOP, OTHER), range(1, 6))
    checked = 0
    for max_tokens, min_tokens, stops, ignore_eos, last, num_out in cases:
        if min_tokens > max_tokens:
            continue  # refused by SamplingParams itself
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stops,
                                ignore_eos=ignore_eos)
        seq = Sequence([1, 2, 3], params, eos_token_ids=(EOS,))
        for _ in range(num_out - 1):
            seq.append_token(OTHER)
        seq.append_token(last)
        expected = stop_reason(params, (EOS,), num_out, last)
        assert seq.check_stop() is (expected is not None)
        assert seq.finish_reason == expected
        assert (seq.status is SequenceStatus.FINISHED) is (expected is not None)
        checked += expected is not None
    assert checked > 50  # the product reaches lengths, stop tokens and EOS, not only the quick path
