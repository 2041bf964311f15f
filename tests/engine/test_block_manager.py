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


def test_decode_steps_hash_each_block_once_and_publish_what_a_fresh_prompt_would_find(monkeypatch):
    """Token by token, only the block that just filled is hashed (looking at every block again made
    each step cost in proportion to the length); the hashes published are the ones a request with
    the same tokens looks up."""
    import epd.engine.block_manager as block_manager
    hashed = []
    real = block_manager.compute_block_hash
    monkeypatch.setattr(block_manager, "compute_block_hash", lambda *a: hashed.append(a[2]) or real(*a))
    bm = BlockManager(num_blocks=64, block_size=4)
    s = seq(range(5))
    bm.allocate(s)
    hashed.clear()  # the prefix lookup's own hashing

    class Looked(list):
        count = 0

        def __getitem__(self, i):
            Looked.count += 1
            return super().__getitem__(i)

    bm.blocks = Looked(bm.blocks)
    compute_all(bm, s)
    for token in range(100, 140):  # 40 decode steps
        s.token_ids.append(token)
        bm.append_slots(s)
        compute_all(bm, s)
    assert hashed == [4 * i for i in range(len(s) // 4)]  # each block's start, once, in order
    # each block looked at a few times (taken, filled, the next one's predecessor), not at every step: 41
    # here, 261 when every step walked the whole table
    assert Looked.count <= 4 * len(s.block_table)
    twin = seq(list(s.token_ids) + [7])
    assert bm.allocate(twin) and twin.num_cached_tokens == 4 * (len(s) // 4)
    assert twin.block_table[:len(s) // 4] == s.block_table[:len(s) // 4]
    bm.free(twin)
    bm.free(s)  # freed and allocated again: hashing starts over from the new table
    assert s.num_hashed_blocks == 0
