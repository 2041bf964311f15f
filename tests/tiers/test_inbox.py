import pytest
import torch

from epd.prefill.inbox import EmbeddingInbox


def test_pushes_in_any_order_fill_the_request_and_release_on_finish():
    arrivals = []
    inbox = EmbeddingInbox(on_arrival=lambda: arrivals.append(1))
    released = []
    rows = inbox.expect("r", [2, 3])
    assert inbox.push("r", 1, torch.ones(3, 4), release=lambda: released.append("b"))
    assert rows.num_ready_rows() == 0  # item 0 still missing
    assert inbox.push("r", 0, torch.zeros(2, 4), release=lambda: released.append("a"))
    assert rows.is_complete() and rows.num_ready_rows() == 5 and len(arrivals) == 2
    assert released == []  # held while the request is prefilled
    inbox.finish("r")
    assert sorted(released) == ["a", "b"]


def test_a_push_for_a_request_not_held_here_is_released_at_once():
    inbox = EmbeddingInbox()
    released = []
    assert not inbox.push("gone", 0, torch.ones(1, 2), release=lambda: released.append(1))
    assert released == [1] and inbox.num_late_pushes == 1 and inbox.num_requests == 0


def test_a_wrong_row_count_fails_the_request_not_the_worker():
    failures = []
    inbox = EmbeddingInbox(on_failure=lambda request_id, error: failures.append((request_id, error)))
    rows = inbox.expect("r", [4])
    assert inbox.push("r", 0, torch.ones(3, 8))
    assert failures == [("r", "item 0: expected 4 embedding rows, got a tensor of shape (3, 8)")]
    assert rows.num_ready_rows() == 0


def test_an_item_index_out_of_range_fails_the_request():
    failures = []
    inbox = EmbeddingInbox(on_failure=lambda request_id, error: failures.append(error))
    inbox.expect("r", [4])
    inbox.push("r", 3, torch.ones(4, 8))
    assert failures == ["encoder pushed item 3 but the request has 1 items"]


def test_the_same_request_twice_is_refused():
    inbox = EmbeddingInbox()
    inbox.expect("r", [1])
    with pytest.raises(ValueError, match="already being prefilled"):
        inbox.expect("r", [1])
