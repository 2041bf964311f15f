"""The prefill tier keys its prefix-cache blocks by image content, fast and without a model: two
requests with the same ids (the same placeholder spans) but different images share the text before
the image and nothing after it."""
import threading

from epd.engine.block_manager import BlockManager
from epd.engine.sequence import Sequence
from epd.prefill.worker import PrefillTicket, PrefillWorker
from epd.types import SamplingParams
from epd.v1 import common_pb2
from epd.wire.protocol import prefill_job_from_proto

PAD, BLOCK = 9, 4
IDS = [1, 2, 3, 4, 5, 6, 7, 8] + [PAD] * 8 + [10, 11, 12, 13, 14]  # the image fills blocks 2 and 3


class _Engine:
    """What ``PrefillWorker`` asks of its engine when it adds a request, over a real block manager."""

    def __init__(self) -> None:
        self.block_manager = BlockManager(64, BLOCK)

    def add_request(self, token_ids, params, *, request_id, mm, mm_items, output_token_ids=()):
        return Sequence(token_ids, params, request_id=request_id, mm=mm, mm_items=mm_items,
                        output_token_ids=output_token_ids)


def job(request_id: str, image_hash: str):
    meta = common_pb2.RequestMetadata(
        request_id=request_id, token_ids=IDS, sampling=common_pb2.SamplingParams(max_tokens=4, top_p=1.0, top_k=-1, temperature=0.0),
        items=[common_pb2.MultimodalItem(item_index=0, modality="image", content_hash=image_hash, offset=8,
                                         expected_rows=8, encoder_tokens=32, grid_thw=[1, 4, 8])])
    return prefill_job_from_proto(meta)


def add(worker: PrefillWorker, engine: _Engine, request_id: str, image_hash: str) -> Sequence:
    ticket = PrefillTicket(job(request_id, image_hash))
    worker._tickets[request_id] = ticket
    seq = worker._add(engine, ticket, None)
    assert engine.block_manager.allocate(seq)
    seq.num_computed_tokens = len(seq)
    engine.block_manager.mark_computed(seq)
    return seq


def test_different_images_behind_the_same_ids_share_only_the_text_before_them():
    worker = object.__new__(PrefillWorker)  # only what adding a request touches
    worker._lock, worker._tickets, worker.overlap_with_encode = threading.Lock(), {}, True
    engine = _Engine()
    first = add(worker, engine, "r1", "image-A")
    assert first.sampling_params == SamplingParams(max_tokens=1)  # prefill samples one token, decode the rest
    again = add(worker, engine, "r2", "image-A")
    other = add(worker, engine, "r3", "image-B")
    assert again.num_cached_tokens == (len(IDS) - 1) // BLOCK * BLOCK  # every full block before the last token
    assert other.num_cached_tokens == 8  # the text before the image, not one block of the image
