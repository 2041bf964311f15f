"""The block tables of recently scheduled sequences, mirrored as rows of one int32 array.

A step's page metadata is then one fancy index of this array (``build_page_metadata``), and what a
step changes is written incrementally: a running sequence gains a page every ``block_size``
tokens, so a decode step usually writes nothing at all. A sequence's table is rewritten whole when
the block manager replaced its list (admission, preemption) or when the sequence is new here.

Rows are a cache: a sequence not seen for a while may lose its row to another and simply gets it
written again when it returns; correctness never depends on what stays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class _Row:
    index: int
    table: list[int]  # the block manager's list object as last written (identity tells a replacement)
    written: int  # entries of it already in the array
    used: int = 0  # the last step that asked for it (the least recently used row goes first)


class BlockTableMirror:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._rows: dict[int, _Row] = {}  # seq id -> its row
        self._free = list(range(rows - 1, -1, -1))
        self._step = 0

    def rows_for(self, seqs) -> np.ndarray:
        """Each sequence's row, its table brought up to date -> int64 [len(seqs)]. Per sequence this
        is a lookup and two comparisons (it runs for every sequence of every step); the sequences
        new here get rows after the pass, which marked every row this step uses."""
        self._step += 1
        step, rows = self._step, self._rows
        out, missing = [], []
        for i, seq in enumerate(seqs):
            row = rows.get(seq.seq_id)
            if row is None:
                missing.append(i)
                out.append(-1)
                continue
            table = seq.block_table
            if row.table is not table or row.written != len(table):
                self._refresh(row, table)
            row.used = step
            out.append(row.index)
        if missing:
            self._make_room(len(missing))
            for i in missing:
                seq = seqs[i]
                row = rows[seq.seq_id] = _Row(self._free.pop(), seq.block_table, 0, step)
                self._write(row, seq.block_table)
                out[i] = row.index
        return np.array(out, dtype=np.int64)

    def refresh(self, seq) -> None:
        """Bring the row of ``seq``, which has one here, up to its table (a page it just gained)."""
        self._refresh(self._rows[seq.seq_id], seq.block_table)

    def release(self, seq) -> None:
        """``seq`` is gone (finished): its row, if it has one, is free for the next sequence."""
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            self._free.append(row.index)

    def ensure_free(self, n: int) -> None:
        """At least ``n`` free rows, the array grown if need be: placing that many new sequences then
        evicts no row (a batch kept elsewhere holds row indices)."""
        if n > len(self._free):
            old = self.array.shape[0]
            new = max(old * 2, old + n - len(self._free))
            self.array = np.concatenate([self.array, np.zeros((new - old, self.array.shape[1]), dtype=np.int32)])
            self._free.extend(range(new - 1, old - 1, -1))

    def _refresh(self, row: _Row, table: list[int]) -> None:
        if row.table is not table or row.written > len(table):  # replaced or shrunk: rewrite
            row.table, row.written = table, 0
        self._write(row, table)

    def _write(self, row: _Row, table: list[int]) -> None:
        if len(table) > self.array.shape[1]:
            grown = np.zeros((self.array.shape[0], max(len(table), 2 * self.array.shape[1])), dtype=np.int32)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        self.array[row.index, row.written:len(table)] = table[row.written:]
        row.written = len(table)

    def _make_room(self, missing: int) -> None:
        """Free ``missing`` rows: evict the least recently used rows of sequences outside this step
        (every row this step uses is marked), and grow the array when this step alone needs more."""
        if missing > len(self._free):
            step = self._step
            for seq_id in sorted((i for i, row in self._rows.items() if row.used != step),
                                 key=lambda i: self._rows[i].used):
                if missing <= len(self._free):
                    break
                self._free.append(self._rows.pop(seq_id).index)
        self.ensure_free(missing)
