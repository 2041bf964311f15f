import pytest
import torch

from epd.engine.mm_inputs import EmbeddingError, ItemRows, SequenceMultimodal


def test_rows_before_a_gap_are_served_while_later_items_arrived_out_of_order():
    rows = ItemRows([2, 3, 4])
    a, c = torch.randn(2, 8), torch.randn(4, 8)
    rows.set_item(2, c)  # the third item's encoder answered first
    assert rows.num_ready_rows() == 0
    rows.set_item(0, a)
    assert rows.num_ready_rows() == 2
    assert torch.equal(rows.rows(0, 2), a)
    with pytest.raises(EmbeddingError, match="only 2 have arrived"):
        rows.rows(0, 3)
    b = torch.randn(3, 8)
    rows.set_item(1, b)
    assert torch.equal(rows.rows(1, 7), torch.cat([a[1:], b, c[:2]]))


def test_a_wrong_row_count_is_refused_with_both_numbers():
    with pytest.raises(EmbeddingError, match="expected 3 embedding rows, got a tensor of shape \\(2, 8\\)"):
        ItemRows([3]).set_item(0, torch.randn(2, 8))


def test_inputs_ready_until_stops_at_the_first_missing_row():
    rows = ItemRows([2, 2])
    mm = SequenceMultimodal(rows, torch.tensor([5, 6, 9, 10]), torch.zeros(12, dtype=torch.long),
                            torch.zeros(3, 12, dtype=torch.long), 0)
    assert mm.inputs_ready_until() == 5
    rows.set_item(0, torch.randn(2, 4))
    assert mm.inputs_ready_until() == 9
    rows.set_item(1, torch.randn(2, 4))
    assert mm.inputs_ready_until() is None


def test_decode_state_holds_only_the_delta():
    mm = SequenceMultimodal.delta_only(7)
    assert mm.is_stripped and mm.mrope_delta == 7 and mm.inputs_ready_until() is None
