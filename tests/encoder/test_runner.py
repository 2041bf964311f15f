import dataclasses

import pytest
import torch

from epd.encoder.cache import CacheEntryState
from epd.encoder.errors import MultimodalEncoderInputError, MultimodalEncoderRequestError
from epd.encoder.runner import MultimodalEncoderRunner
from epd.errors import InvalidRequest

from .fakes import FakeEncoder, expected_output, make_item
from .test_item_scheduler import names, scheduler


@pytest.fixture
def setup():
    s = scheduler()
    model = FakeEncoder()
    return s, model, MultimodalEncoderRunner(model, s)


def test_forward_items_commits_marks_ready_and_strips_payloads(setup):
    s, model, runner = setup
    s.add_request("r0", [make_item("a"), make_item("b", rows=3)])
    s.add_request("r1", [make_item("b", rows=3)])  # consumer of r0's "b"
    ready = runner.forward_items(s.schedule())
    assert model.batches == [["a", "b"]]
    assert sorted(state.request_id for state in ready) == ["r0", "r1"]
    for state in ready:
        assert state.items == [None] * len(state.cache_keys)  # raw media dropped once fully ready
        assert all(entry.state is CacheEntryState.READY for entry in state.entries)
    a, b = ready[0].entries
    assert torch.equal(a.tensor, expected_output("a")) and torch.equal(b.tensor, expected_output("b", 3))
    # cached outputs own their storage: a view of the merged batch output would pin all of it
    assert b.tensor.untyped_storage().nbytes() == b.tensor.nbytes == b.nbytes
    assert s.num_waiting_requests == 0


def test_only_model_declared_inputs_move_to_the_device():
    s = scheduler()
    model = FakeEncoder()
    runner = MultimodalEncoderRunner(model, s, device="meta")
    s.add_request("r0", [make_item("a")])
    runner.forward_items(s.schedule())
    assert model.devices == [("meta", "cpu")]  # pixel_values moved, grid_thw stays for Python reads


def test_wrong_shape_fails_every_user_of_that_key_and_commits_nothing(setup):
    s, model, runner = setup
    s.add_request("r0", [make_item("good")])
    s.add_request("r1", [make_item("bad")])
    s.add_request("r2", [make_item("bad"), make_item("other")])  # consumer of "bad"
    s.add_request("r3", [make_item("other")])
    model.wrong_rows["bad"] = 5
    batch = s.schedule()
    assert names(batch) == ["good", "bad", "other"]
    bad_entry = s.get_request("r1").entries[0]
    with pytest.raises(MultimodalEncoderRequestError) as info:
        runner.forward_items(batch)
    assert info.value.request_ids == {"r1", "r2"}
    assert str(info.value) == ("MM item 0 of request 'r1' (content hash bad) must produce a torch.float32 "
                               "tensor with shape (2, 4), got shape (5, 4) dtype torch.float32")
    with pytest.raises(MultimodalEncoderRequestError, match="got shape"):
        bad_entry.wait(0)
    # nothing of the batch was published; the innocent items wait under their producers
    good = s.get_request("r0").entries[0]
    assert good.state is CacheEntryState.PENDING and not good.is_in_flight and good.producer_request_id == "r0"
    assert s.cache.bytes == 0
    for request_id in info.value.request_ids:  # what the engine does with the error
        s.abort_request(request_id)
    model.wrong_rows.clear()
    batch = s.schedule()
    assert [(x.request_id, x.item.content_hash) for x in batch.items] == [("r0", "good"), ("r3", "other")]
    assert sorted(st.request_id for st in runner.forward_items(batch)) == ["r0", "r3"]


def test_an_undecodable_item_fails_only_its_users_as_a_bad_request_and_the_rest_encode(setup):
    s, model, runner = setup
    s.add_request("r0", [make_item("good")])
    s.add_request("r1", [make_item("broken")])
    s.add_request("r2", [make_item("other"), make_item("broken")])  # a consumer of "broken"
    model.undecodable.add("broken")
    with pytest.raises(MultimodalEncoderInputError) as info:
        runner.forward_items(s.schedule())
    assert isinstance(info.value, InvalidRequest)  # a 400 at the edge, not a 502
    assert info.value.request_ids == {"r1", "r2"}
    assert str(info.value) == "image (content hash broken): PNG data is truncated or corrupt (broken)"
    for request_id in info.value.request_ids:  # what the engine does with the error
        s.abort_request(request_id)
    batch = s.schedule()  # the innocent item is batched again and encodes
    assert [(x.request_id, x.item.content_hash) for x in batch.items] == [("r0", "good")]
    assert [st.request_id for st in runner.forward_items(batch)] == ["r0"]


def test_two_users_bad_images_in_one_batch_are_each_told_only_of_their_own(setup):
    s, model, runner = setup
    s.add_request("alice", [make_item("alice-img")])
    s.add_request("bob", [make_item("bob-img")])
    s.add_request("both", [make_item("alice-img"), make_item("bob-img")])
    model.undecodable |= {"alice-img", "bob-img"}
    with pytest.raises(MultimodalEncoderInputError) as info:
        runner.forward_items(s.schedule())
    assert info.value.request_ids == {"alice", "bob", "both"}
    told = {rid: str(info.value.for_request(rid)) for rid in info.value.request_ids}
    assert told["alice"] == "image (content hash alice-img): PNG data is truncated or corrupt (alice-img)"
    assert told["bob"] == "image (content hash bob-img): PNG data is truncated or corrupt (bob-img)"
    assert "alice-img" in told["both"] and "bob-img" in told["both"]  # both its own parts are named
    assert isinstance(info.value.for_request("alice"), InvalidRequest)


def test_a_callers_label_names_the_item_but_the_content_hash_keys_it(setup):
    s, model, runner = setup
    labelled = dataclasses.replace(make_item("x"), label="what-the-router-called-it")
    s.add_request("r0", [labelled])
    model.undecodable.add("x")
    with pytest.raises(MultimodalEncoderInputError, match=r"^image \(content hash what-the-router-called-it\): "):
        runner.forward_items(s.schedule())


def test_wrong_dtype_is_a_validation_failure(setup):
    s, model, runner = setup
    s.add_request("r0", [make_item("a")])
    model.wrong_dtype.add("a")
    with pytest.raises(MultimodalEncoderRequestError, match=r"torch.float32 tensor with shape \(2, 4\), "
                                                            r"got shape \(2, 4\) dtype torch.float16"):
        runner.forward_items(s.schedule())


def test_batch_level_error_fails_only_producers_and_a_consumer_produces_next_pass(setup):
    s, model, runner = setup
    s.add_request("producer", [make_item("a")])
    s.add_request("consumer", [make_item("a")])
    entry = s.get_request("consumer").entries[0]
    model.fail_next_encodes = 1
    with pytest.raises(MultimodalEncoderRequestError, match="failed: RuntimeError: CUDA out of memory") as info:
        runner.forward_items(s.schedule())
    assert info.value.request_ids == {"producer"}
    assert entry.state is CacheEntryState.PENDING and entry.producer_request_id is None
    s.abort_request("producer")
    batch = s.schedule()
    assert [(x.request_id, x.item.content_hash) for x in batch.items] == [("consumer", "a")]
    (state,) = runner.forward_items(batch)
    assert state.request_id == "consumer" and torch.equal(entry.wait(0), expected_output("a"))
    assert entry.produced_by == "consumer"


def test_output_count_mismatch_is_batch_level(setup):
    s, model, runner = setup
    s.add_request("r0", [make_item("a"), make_item("b")])
    model.encode = lambda pixel_values, grid_thw: [expected_output("a")]
    with pytest.raises(MultimodalEncoderRequestError, match="encoder returned 1 outputs for 2 items") as info:
        runner.forward_items(s.schedule())
    assert info.value.request_ids == {"r0"}
