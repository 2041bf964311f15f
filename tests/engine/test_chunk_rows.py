"""Which embedding rows a prefill chunk takes (the model runner's ``_chunk_mm_rows``), fast, on
plain tensors: chunks that cut through images, rows sliced before they are joined, bookkeeping
kept on CPU, and sequences that cannot locate their rows fail instead of dropping an image."""
import pytest
import torch

from epd.engine.mm_inputs import ItemRows, SequenceMultimodal
from epd.engine.model_runner import _chunk_mm_rows
from epd.engine.scheduler import ScheduledChunk
from epd.engine.sequence import Sequence
from epd.multimodal.layout import build_prompt_layout
from epd.types import MultimodalItemSpan, SamplingParams

PAD = 9  # the placeholder id
# 3 text, image A (4 rows), 2 text, image B (6 rows), 3 text: 18 tokens
IDS = [1, 2, 3] + [PAD] * 4 + [4, 5] + [PAD] * 6 + [6, 7, 8]
ITEMS = [MultimodalItemSpan(3, 4, "a", (1, 4, 4)), MultimodalItemSpan(9, 6, "b", (1, 4, 6))]


def sequence() -> tuple[Sequence, list[torch.Tensor]]:
    layout = build_prompt_layout(IDS, ITEMS, mm_token_ids=[PAD],
                                 positions_fn=lambda n, spans: (torch.arange(n).expand(3, -1), 0))
    tensors = [torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5),
               100 + torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)]
    mm = SequenceMultimodal.from_layout(layout, ItemRows.from_tensors(tensors))
    return Sequence(IDS, SamplingParams(), mm=mm, mm_items=ITEMS), tensors


@pytest.mark.parametrize("start, end, rows_a, rows_b", [
    (0, 3, None, None),            # text only: no rows
    (0, 5, (0, 2), None),          # cuts image A after 2 rows
    (5, 11, (2, 4), (0, 2)),       # the rest of A, text, the start of B
    (11, 18, None, (2, 6)),        # the rest of B and the closing text
    (0, 18, (0, 4), (0, 6)),       # the whole prompt at once
])
def test_a_chunk_takes_exactly_the_rows_of_the_placeholders_it_covers(start, end, rows_a, rows_b):
    seq, (a, b) = sequence()
    rows, local = _chunk_mm_rows(seq.mm, ScheduledChunk(seq, start, end - start), seq.num_prompt_tokens)
    expected = [t[lo:hi] for t, span in ((a, rows_a), (b, rows_b)) if span for lo, hi in [span]]
    if not expected:
        assert rows is None and local is None
        return
    assert torch.equal(rows, torch.cat(expected))
    positions = [p for p in range(start, end) if IDS[p] == PAD]
    assert local.tolist() == [p - start for p in positions]  # chunk-local positions of the rows


def test_rows_inside_one_item_are_a_view_and_across_items_only_the_needed_rows_are_copied():
    seq, (a, b) = sequence()
    inside, _ = _chunk_mm_rows(seq.mm, ScheduledChunk(seq, 11, 3), seq.num_prompt_tokens)
    assert inside.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # no copy at all
    across, _ = _chunk_mm_rows(seq.mm, ScheduledChunk(seq, 5, 6), seq.num_prompt_tokens)
    assert across.shape[0] == 4
    assert across.untyped_storage().nbytes() == 4 * 5 * 4  # the 4 rows it needs, not all 10 of the request


def test_bookkeeping_on_an_accelerator_is_refused():
    layout = build_prompt_layout(IDS, ITEMS, mm_token_ids=[PAD],
                                 positions_fn=lambda n, spans: (torch.arange(n).expand(3, -1), 0))
    for name in ("embed_positions", "embed_mask_cumsum", "mrope_positions"):
        fields = {"embed_positions": layout.embed_positions, "embed_mask_cumsum": layout.embed_mask_cumsum,
                  "mrope_positions": layout.mrope_positions}
        fields[name] = fields[name].to("meta")
        with pytest.raises(ValueError, match=f"{name} must stay on CPU, got meta"):
            SequenceMultimodal(None, **fields, mrope_delta=0)


def test_rows_that_cannot_be_located_fail_instead_of_dropping_the_image():
    seq, _ = sequence()
    seq.mm.embed_mask_cumsum = None  # e.g. a layout that was never built
    with pytest.raises(RuntimeError, match="cannot locate its embedding rows"):
        _chunk_mm_rows(seq.mm, ScheduledChunk(seq, 0, 5), seq.num_prompt_tokens)
    seq, _ = sequence()
    seq.mm.strip_for_generation()
    with pytest.raises(RuntimeError, match="already stripped"):
        _chunk_mm_rows(seq.mm, ScheduledChunk(seq, 0, 5), seq.num_prompt_tokens)
    assert _chunk_mm_rows(seq.mm, ScheduledChunk(seq, 18, 1), seq.num_prompt_tokens) == (None, None)  # decode
