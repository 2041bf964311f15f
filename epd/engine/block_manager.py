"""Paged KV block manager with prefix caching (plain Python: no torch, testable with fakes).

A block's hash chains the previous block's hash, the block's token ids and the content hashes of
the multimodal items that overlap it. Image placeholders are all the same token id, so without the
mm hashes two different images would share cached KV.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import blake3

from epd.engine.sequence import Sequence
from epd.types import MultimodalItemSpan


@dataclass(slots=True)
class Block:
    """One page's bookkeeping. Nothing in it is a container: a cache has tens of thousands of
    blocks, and a list per block (as its token ids were, never read) is that many more objects for
    every full garbage collection to walk."""
    block_id: int
    ref_count: int = 0
    block_hash: str | None = None


def compute_block_hash(prev_hash: str | None, token_ids: list[int], block_start: int,
                       mm_items: list[MultimodalItemSpan]) -> str:
    """Hash of one full block: prefix chain + tokens + (mm hash, offset) of overlapping items."""
    h = blake3.blake3()
    h.update((prev_hash or "").encode())
    # fixed-width ids: unambiguous, and half the cost of formatting them (a decode batch of 256
    # publishes 16 blocks a step)
    h.update(b"|t|" + array("q", token_ids).tobytes())
    block_end = block_start + len(token_ids)
    for item in mm_items:
        if item.offset < block_end and item.end > block_start:
            # the offset relative to the block says which rows of the item this block holds
            h.update(f"|m|{item.mm_hash}@{item.offset - block_start}".encode())
    return h.hexdigest()


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in LRU order: reuse the least recently freed first so cached prefixes live longest
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[str, int] = {}
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[str]:
        hashes, prev = [], None
        for i in range(num_tokens // self.block_size):
            start = i * self.block_size
            prev = compute_block_hash(prev, seq.token_ids[start:start + self.block_size], start, seq.mm_items)
            hashes.append(prev)
        return hashes

    def _lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids for the longest prefix, never covering the last token (which must be
        computed to produce logits)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash in self._full_block_hashes(seq, len(seq.token_ids) - 1):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Give a waiting sequence blocks for all its tokens (or ``num_tokens`` if more, to reserve
        room ahead), reusing cached prefix blocks. Returns False (and changes nothing) if there are
        not enough free blocks."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._lookup_prefix(seq)
        num_needed = seq.num_blocks_needed(self.block_size, max(len(seq), num_tokens or 0))
        # a hit on a free block takes it out of the free list, so only in-use hits come for free
        num_free_needed = num_needed - sum(1 for b in hits if self.blocks[b].ref_count > 0)
        if num_free_needed > self.num_free_blocks:
            return False
        for block_id in hits:
            self._take(block_id)
        fresh = [self._pop_free() for _ in range(num_needed - len(hits))]
        for block_id in fresh:
            self._take(block_id)
        seq.block_table, seq.num_hashed_blocks = hits + fresh, 0
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        self.num_prefix_query_tokens += len(seq)
        return True

    def can_append(self, seq: Sequence) -> bool:
        missing = seq.num_blocks_needed(self.block_size) - len(seq.block_table)
        return missing <= 0 or missing <= self.num_free_blocks

    def append_slots(self, seq: Sequence) -> None:
        """Grow the block table to cover every token of the sequence (after a sampled token)."""
        missing = seq.num_blocks_needed(self.block_size) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"{seq.request_id} needs {missing} more KV blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            block_id = self._pop_free()
            self._take(block_id)
            seq.block_table.append(block_id)

    def mark_computed(self, seq: Sequence) -> None:
        """Publish hashes of blocks that are now full and computed, so later requests can reuse them.
        Only the blocks filled since the last call are hashed (``seq.num_hashed_blocks``): looking
        at every block again made each decode step cost in proportion to the sequence's length."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size  # tokens known here
        first = seq.num_hashed_blocks
        if num_full <= first:
            return
        prev = self.blocks[seq.block_table[first - 1]].block_hash if first else None
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                start = i * self.block_size
                tokens = seq.token_ids[start:start + self.block_size]
                block.block_hash = compute_block_hash(prev, tokens, start, seq.mm_items)
                self._hash_to_block.setdefault(block.block_hash, block.block_id)
            prev = block.block_hash
        seq.num_hashed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        # free in reverse so a sequence's tail blocks are evicted before its (more shareable) head
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table, seq.num_hashed_blocks = [], 0

    # ---- internals -----------------------------------------------------------------------
    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block_id:
            del self._hash_to_block[block.block_hash]  # evict: its contents are about to change
        block.block_hash = None
        return block_id

    def _take(self, block_id: int) -> None:
        self._free.pop(block_id, None)
        self.blocks[block_id].ref_count += 1
