"""The block-table mirror: whatever the history (new sequences, growth, replaced tables, more
sequences than rows), each sequence's row holds exactly its current table."""
from __future__ import annotations

import random

import numpy as np

from epd.engine.block_tables import BlockTableMirror


class Seq:
    def __init__(self, seq_id: int) -> None:
        self.seq_id, self.block_table = seq_id, []


def test_each_row_holds_its_sequences_table_through_growth_replacement_and_eviction():
    rng = random.Random(7)
    mirror = BlockTableMirror(rows=4, width=2)
    seqs = [Seq(i) for i in range(12)]
    for _ in range(300):
        step = rng.sample(seqs, rng.randint(1, 9))  # sometimes more than the array has rows
        for seq in step:
            action = rng.random()
            if action < 0.6:
                seq.block_table.append(rng.randrange(1000))  # a decode crossed into a new page
            elif action < 0.7:
                seq.block_table = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]  # preempted, re-admitted
        rows = mirror.rows_for(step)
        assert len(set(rows.tolist())) == len(step)  # one row each
        for seq, row in zip(step, rows):
            assert mirror.array[row, :len(seq.block_table)].tolist() == seq.block_table


def test_a_step_of_known_sequences_writes_only_what_grew():
    mirror = BlockTableMirror(rows=4, width=8)
    seqs = [Seq(i) for i in range(3)]
    for seq in seqs:
        seq.block_table = [10 * seq.seq_id, 10 * seq.seq_id + 1]
    mirror.rows_for(seqs)
    before = mirror.array.copy()
    mirror.array[:, 5:] = -1  # columns no table reaches: a rewrite would not touch them either
    seqs[1].block_table.append(99)
    rows = mirror.rows_for(seqs)
    changed = np.argwhere(mirror.array[:, :5] != before[:, :5])
    assert changed.tolist() == [[int(rows[1]), 2]]  # the one new page, nothing rewritten
