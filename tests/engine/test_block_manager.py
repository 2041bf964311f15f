import pytest

from epd.engine.block_manager import BlockManager
from epd.engine.sequence import Sequence
from epd.types import MultimodalItemSpan, SamplingParams


def seq(tokens, items=None):
    return Sequence(list(tokens), SamplingParams(max_tokens=4), mm_items=items)


def compute_all(bm, s):
    s.num_computed_tokens = len(s)
    bm.mark_computed(s)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_prefix_hit_reuses_computed_full_blocks_but_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(range(12))  # identical prompt: the last block must still be computed for logits
    assert bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    c = seq(list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.allocate(c) and c.num_cached_tokens == 8


def test_same_tokens_different_image_hash_do_not_share_kv():
    bm = BlockManager(num_blocks=16, block_size=4)
    pads = [7] * 8 + [1, 2, 3]
    a = seq(pads, [MultimodalItemSpan(0, 8, "image-A")])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq(pads, [MultimodalItemSpan(0, 8, "image-B")])
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    c = seq(pads, [MultimodalItemSpan(0, 8, "image-A")])
    bm.allocate(c)
    assert c.num_cached_tokens == 8


def test_freed_blocks_keep_their_hash_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = seq(range(9))
    assert bm.allocate(b) and b.num_cached_tokens == 8
    bm.free(b)
    # take every block for other content: the cached prefix must be evicted, not served stale
    filler = seq(range(100, 116))
    assert bm.allocate(filler)
    compute_all(bm, filler)
    bm.free(filler)
    c = seq(range(9))
    assert bm.allocate(c) and c.num_cached_tokens == 0


def test_allocate_without_room_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.allocate(s)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_append_slots_grows_on_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(range(4))
    bm.allocate(s)
    assert len(s.block_table) == 1
    s.append_token(5)
    assert bm.can_append(s)
    bm.append_slots(s)
    assert len(s.block_table) == 2


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
