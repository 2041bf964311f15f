"""A request's moves off lost workers (the router's bookkeeping): each move resumes after what was
streamed, under a request id of its own on the workers, within its budget and deadline."""
from __future__ import annotations

import time

import pytest

from epd.errors import UpstreamError
from epd.models.spec import ProcessedPrompt
from epd.router.backends.base import BackendOutput, Job
from epd.router.backends.moves import Moves
from epd.types import SamplingParams


def _job(deadline_in_s: float = 60.0) -> Job:
    prompt = ProcessedPrompt(prompt_token_ids=[1, 2, 3], items=[], item_metadata=None)
    return Job("req#ab12", prompt, SamplingParams(max_tokens=8), (0,), time.monotonic() + deadline_in_s)


def test_a_move_before_the_first_token_redispatches_and_one_after_it_migrates_with_the_tokens_so_far():
    moves = Moves(_job(), max_moves=2)
    assert moves.move(UpstreamError("prefill 127.0.0.1:1 failed the request: gone")) == "redispatched"
    assert (moves.job.request_id, moves.job.output_token_ids) == ("req#ab12.m1", ())
    moves.streamed(BackendOutput([7]))
    moves.streamed(BackendOutput([8, 9]))
    assert moves.move(UpstreamError("decode 127.0.0.1:2 failed the request: gone")) == "migrated"
    assert (moves.job.request_id, moves.job.output_token_ids) == ("req#ab12.m2", (7, 8, 9))
    assert moves.job.prompt is moves.original.prompt and moves.job.deadline_s == moves.original.deadline_s


def test_a_request_out_of_moves_fails_naming_the_tier_and_the_moves_it_made():
    moves = Moves(_job(), max_moves=1)
    moves.move(UpstreamError("decode 127.0.0.1:2 failed the request: gone"))
    with pytest.raises(UpstreamError, match=r"decode 127.0.0.1:3 failed the request: gone \(after 1 moves, "
                                            r"max_migrations reached\)"):
        moves.move(UpstreamError("decode 127.0.0.1:3 failed the request: gone"))


def test_no_move_allowed_or_no_time_left_passes_the_tiers_error_on():
    error = UpstreamError("encoder 127.0.0.1:4 failed the request: gone")
    with pytest.raises(UpstreamError) as raised:
        Moves(_job(), max_moves=0).move(error)
    assert raised.value is error
    with pytest.raises(UpstreamError) as raised:  # out of time: the same error, not a move budget's
        Moves(_job(deadline_in_s=-1.0), max_moves=3).move(error)
    assert raised.value is error


def test_a_move_away_from_a_failed_producer_makes_the_next_attempts_avoid_it():
    from epd.router.backends.moves import blaming_producer as _blaming_producer

    moves = Moves(_job(), max_moves=3)
    plain = UpstreamError("prefill 127.0.0.1:5 failed the request: worker gone")
    assert _blaming_producer(plain, {0: "127.0.0.1:1"}) is plain
    blamed = _blaming_producer(UpstreamError("prefill 127.0.0.1:5 failed the request: request r: embeddings "
                                             "unusable: import failed for item 1: owner of epd_1_ab is gone"),
                               {0: "127.0.0.1:1", 1: "127.0.0.1:2"})
    assert blamed.producer == "127.0.0.1:2" and blamed.message.endswith("(rows from encoder 127.0.0.1:2)")
    moves.move(plain)
    assert moves.avoid == set()
    moves.move(blamed)
    assert moves.avoid == {"127.0.0.1:2"}


def test_a_blamed_producer_is_passed_over_for_a_pause_that_doubles_while_blames_come_in_a_row():
    from epd.router.backends.moves import Suspects

    now = [100.0]
    suspects = Suspects(base_s=30.0, max_s=600.0, clock=lambda: now[0])
    assert suspects.blame("e1") == 30.0 and suspects.current() == {"e1"}
    now[0] += 31.0
    assert suspects.current() == set() and suspects.remaining_s("e1") == 0.0  # traffic goes back
    assert suspects.blame("e1") == 60.0  # failed again soon after: a longer pause
    assert suspects.blame("e1") == 120.0 and suspects.remaining_s("e1") == 120.0
    for _ in range(5):
        suspects.blame("e1")
    assert suspects.remaining_s("e1") == 600.0  # capped
    now[0] += 601.0 + 600.0
    assert suspects.blame("e1") == 30.0  # a blame long after the last starts over
    assert suspects.blame("e2") == 30.0 and suspects.current() == {"e1", "e2"}
