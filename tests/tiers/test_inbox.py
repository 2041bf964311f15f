import torch

from epd.prefill.inbox import EmbeddingInbox


def test_pushes_before_the_request_are_applied_when_it_arrives():
    inbox = EmbeddingInbox()
    released = []
    inbox.push("r", 1, torch.ones(3, 4), None, release=lambda: released.append("b"))
    rows = inbox.expect("r", [2, 3])
    assert rows.num_ready_rows() == 0  # item 0 still missing
    inbox.push("r", 0, torch.zeros(2, 4), None, release=lambda: released.append("a"))
    assert rows.is_complete() and rows.num_ready_rows() == 5
    inbox.finish("r")
    assert sorted(released) == ["a", "b"]


def test_an_abort_that_overtakes_its_request_fails_it_on_arrival():
    inbox = EmbeddingInbox()
    assert inbox.fail_request("r", "encoder 1.2.3.4 failed") is False
    rows = inbox.expect("r", [2])
    assert rows.first_error() == "item 0: encoder 1.2.3.4 failed"


def test_parked_pushes_expire_and_release_their_leases():
    now = [0.0]
    inbox = EmbeddingInbox(park_ttl_s=5, clock=lambda: now[0])
    released = []
    inbox.push("gone", 0, torch.ones(1, 2), None, release=lambda: released.append(1))
    now[0] = 10
    assert inbox.sweep() == 1 and released == [1] and inbox.num_parked == 0


def test_a_wrong_row_count_fails_the_item_not_the_worker():
    inbox = EmbeddingInbox()
    rows = inbox.expect("r", [4])
    inbox.push("r", 0, torch.ones(3, 8), None)
    assert "expected 4 embedding rows" in rows.first_error()
