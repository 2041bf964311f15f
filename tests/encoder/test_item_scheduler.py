import logging

import pytest

from epd.config import EncoderConfig
from epd.encoder.cache import CacheEntryState, TensorLRUCache
from epd.encoder.errors import MultimodalEncoderAdmissionError
from epd.encoder.item_scheduler import EncoderBudgets, EncoderItem, MultimodalItemScheduler

from .fakes import BYTES_PER_ROW, make_item


def scheduler(*, batch=8, tokens=1000, output_rows=100, cache_rows=None) -> MultimodalItemScheduler:
    budgets = EncoderBudgets(
        encoder_batch_size=batch, configured_encoder_max_num_tokens=tokens, encoder_max_num_tokens=tokens,
        model_max_atomic_item_tokens=tokens, bytes_per_embedding=BYTES_PER_ROW,
        output_budget_bytes=output_rows * BYTES_PER_ROW,
        encoder_cache_max_bytes=(cache_rows or output_rows) * BYTES_PER_ROW)
    return MultimodalItemScheduler(budgets, TensorLRUCache(budgets.encoder_cache_max_bytes), model_id="m")


def names(batch) -> list[str]:
    return [s.item.content_hash for s in batch.items]


def test_batch_size_binds():
    s = scheduler(batch=2)
    for i in range(3):
        s.add_request(f"r{i}", [make_item(f"img{i}")])
    assert names(s.schedule()) == ["img0", "img1"]
    assert names(s.schedule()) == ["img2"]  # the first two are in flight
    assert s.schedule().is_empty


def test_encoder_token_budget_binds_and_never_splits_an_item():
    s = scheduler(tokens=20)
    s.add_request("r0", [make_item("a", tokens=8), make_item("b", tokens=8), make_item("c", tokens=8)])
    batch = s.schedule()
    assert names(batch) == ["a", "b"] and batch.num_encoder_tokens == 16
    assert names(s.schedule()) == ["c"]


def test_output_byte_budget_binds():
    s = scheduler(output_rows=5, cache_rows=50)
    s.add_request("r0", [make_item("a", rows=3)])
    s.add_request("r1", [make_item("b", rows=3)])
    batch = s.schedule()
    assert names(batch) == ["a"] and batch.output_bytes == 3 * BYTES_PER_ROW
    assert names(s.schedule()) == ["b"]


def test_fifo_stops_at_the_first_item_that_does_not_fit():
    # a large item is never overtaken forever by smaller ones queued behind it
    s = scheduler(tokens=20)
    s.add_request("r0", [make_item("small", tokens=5)])
    s.add_request("r1", [make_item("large", tokens=20)])
    s.add_request("r2", [make_item("tiny", tokens=1)])
    assert names(s.schedule()) == ["small"]
    assert names(s.schedule()) == ["large"]
    assert names(s.schedule()) == ["tiny"]


def test_consumers_and_duplicates_are_not_scheduled_twice():
    s = scheduler()
    s.add_request("r0", [make_item("a"), make_item("a"), make_item("b")])
    s.add_request("r1", [make_item("b"), make_item("c")])
    batch = s.schedule()
    assert names(batch) == ["a", "b", "c"]
    assert [x.request_id for x in batch.items] == ["r0", "r0", "r1"]
    assert batch.producer_request_ids == {"r0", "r1"}
    assert s.schedule().is_empty


def test_fully_cached_request_is_ready_at_once_and_not_queued():
    s = scheduler()
    s.add_request("r0", [make_item("a")])
    batch = s.schedule()
    s.cache.commit(batch.items[0].cache_key, memoryview(bytes(2 * BYTES_PER_ROW)))
    assert [st.request_id for st in s.mark_cache_keys_ready(batch.cache_keys)] == ["r0"]
    state = s.add_request("r1", [make_item("a")])
    assert state.is_ready and s.num_waiting_requests == 0
    assert state.entries[0].state is CacheEntryState.READY


def test_pinned_cache_full_holds_scheduling_until_release():
    s = scheduler(output_rows=4)
    s.add_request("r0", [make_item("a", rows=4)])
    batch = s.schedule()
    s.cache.commit(batch.items[0].cache_key, memoryview(bytes(4 * BYTES_PER_ROW)))
    (state,) = s.mark_cache_keys_ready(batch.cache_keys)  # r0 still pins "a"
    s.add_request("r1", [make_item("b", rows=4)])
    assert s.schedule().is_empty
    s.cache.unpin(state.cache_keys[0], "r0")
    assert names(s.schedule()) == ["b"]


def test_create_raises_the_token_budget_and_logs_the_three_numbers(caplog):
    with caplog.at_level(logging.INFO, logger="epd.encoder.item_scheduler"):
        s = MultimodalItemScheduler.create(
            EncoderConfig(encoder_max_num_tokens=100), model_id="m", model_max_atomic_item_tokens=256,
            bytes_per_embedding=BYTES_PER_ROW, encoder_tokens_per_row=4)
    (record,) = [r for r in caplog.records if "token budget" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "configured=100, effective=256, model_atomic_max=256" in record.getMessage()
    b = s.budgets
    assert (b.configured_encoder_max_num_tokens, b.encoder_max_num_tokens) == (100, 256)
    # (C) defaults to the rows one legal iteration can produce: 256 tokens / 4 per row
    assert b.output_budget_bytes == 64 * BYTES_PER_ROW
    assert b.encoder_cache_max_bytes == s.cache.capacity_bytes == b.output_budget_bytes
    s.add_request("r0", [make_item("largest", rows=64, tokens=256)])
    assert names(s.schedule()) == ["largest"]


def test_create_grows_the_same_cache_and_rejects_a_cache_below_the_output_budget():
    s = MultimodalItemScheduler.create(
        EncoderConfig(max_output_rows=10, encoder_cache_max_bytes=1000 * BYTES_PER_ROW), model_id="m",
        model_max_atomic_item_tokens=40, bytes_per_embedding=BYTES_PER_ROW)
    assert s.budgets.output_budget_bytes == 10 * BYTES_PER_ROW
    assert s.cache.capacity_bytes == 1000 * BYTES_PER_ROW  # (D): one pool, larger than (C)
    with pytest.raises(ValueError, match=r"encoder_cache_max_bytes \(D\)=16 must be >= output_budget_bytes \(C\)=160"):
        MultimodalItemScheduler.create(
            EncoderConfig(max_output_rows=10, encoder_cache_max_bytes=16), model_id="m",
            model_max_atomic_item_tokens=40, bytes_per_embedding=BYTES_PER_ROW)


def test_never_fitting_requests_are_rejected_naming_the_limit():
    s = scheduler(tokens=100, output_rows=10)
    with pytest.raises(MultimodalEncoderAdmissionError,
                       match=r"'r0' item 1 produces 176 output bytes \(11 rows x 16 bytes\), over "
                             r"output_budget_bytes=160 \(C"):
        s.add_request("r0", [make_item("a"), make_item("b", rows=11, tokens=44)])
    with pytest.raises(MultimodalEncoderAdmissionError,
                       match=r"'r1' produces 192 output bytes over 2 items \(12 rows x 16 bytes\), "
                             r"over output_budget_bytes=160"):
        s.add_request("r1", [make_item("a", rows=6), make_item("b", rows=6)])
    with pytest.raises(MultimodalEncoderAdmissionError,
                       match=r"item 0 needs 101 encoder tokens, over encoder_max_num_tokens=100"):
        s.add_request("r2", [make_item("a", rows=1, tokens=101)])
    assert s.num_waiting_requests == 0 and len(s.cache) == 0


def test_abort_frees_the_entry_for_a_consumer():
    s = scheduler()
    s.add_request("r0", [make_item("a")])
    s.add_request("r1", [make_item("a")])
    s.abort_request("r0")
    batch = s.schedule()
    assert [(x.request_id, x.item.content_hash) for x in batch.items] == [("r1", "a")]


def test_items_accept_mappings_and_reject_missing_fields():
    item = make_item("a")
    as_dict = {f: getattr(item, f) for f in ("data", "content_hash", "processor_kwargs_hash",
                                             "expected_rows", "encoder_tokens")}
    assert EncoderItem.coerce(as_dict) == item
    with pytest.raises(ValueError, match=r"lacks \['encoder_tokens'\]"):
        EncoderItem.coerce({k: v for k, v in as_dict.items() if k != "encoder_tokens"})
    with pytest.raises(ValueError, match="expected_rows must be a positive int, got 0"):
        EncoderItem(b"x", "h", "k", 0, 1)
