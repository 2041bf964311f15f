"""The decode batch kept from step to step (what vLLM calls its persistent batch).

While a running sequence decodes, a step differs from the one before in one way for it: it is one
token further. So the decoding sequences are kept as arrays whose rows move on by one each step
(positions, the tokens just sampled, the same block-table rows), not read again from every
sequence, and what the step's tokens change is array arithmetic too: which rows filled a page (to
publish for the prefix cache), which need a new one, which may have stopped. What stays per
sequence is what the sequences themselves hold: the token appended to its list and its computed
count (every other part of the engine, the tiers and a migration read them).

Sequences join as rows when they start decoding (an imported one at admission, a prompt after its
last chunk) and leave as rows when they finish. Prompts still to compute and new arrivals are
scheduled beside the rows, one by one, in the same step. The batch is rebuilt from the
scheduler's running list when that list changed otherwise (an abort: ``Scheduler.changes``) or a
step ran without it (``invalidate``): a step that must preempt is the scheduler's general case,
and runs as one.
"""
from __future__ import annotations

import numpy as np

from epd.engine.block_manager import BlockManager
from epd.engine.block_tables import BlockTableMirror
from epd.engine.sampler import SampleRows
from epd.engine.scheduler import Scheduler
from epd.engine.sequence import Sequence, SequenceStatus
from epd.types import TokenLogprobs


class DecodeBatch:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: list[Sequence] = []
        self.ids: set[int] = set()  # the rows' sequence ids
        self.changes = -1  # the scheduler's count of changes when the arrays were built
        self.stale = True
        self.starts = self.deltas = self.rows = self.pages = self.token_ids = self.tokens_left = np.zeros(0, np.int64)
        self.ending = np.zeros(1, dtype=bool)  # token id -> may end some sequence (the last entry: past every one)
        self.sample_rows: SampleRows | None = None

    def invalidate(self) -> None:
        """A step ran without this batch: the sequences moved on, the arrays did not."""
        self.stale = True

    def refresh(self, scheduler: Scheduler, mirror: BlockTableMirror) -> None:
        """Rebuild the rows if the running sequences changed since. The running sequences the
        arrays cannot describe (a prompt still to compute) and the waiting ones are scheduled beside
        them, one by one (``Scheduler.schedule_beside``)."""
        if self.stale or self.changes != scheduler.changes:
            self._build(scheduler.running, mirror)
            self.changes, self.stale = scheduler.changes, False

    def fits(self, scheduler: Scheduler) -> bool:
        """At least one row, and every row within this step's token budget."""
        return 0 < len(self.seqs) <= scheduler.config.max_num_batched_tokens

    def _build(self, running: list[Sequence], mirror: BlockTableMirror) -> None:
        self.seqs = [seq for seq in running if _decodes(seq)]
        self.ids = {seq.seq_id for seq in self.seqs}
        self._set_columns(np.array(_columns(self.seqs), dtype=np.int64).reshape(-1, 5))
        self.rows = mirror.rows_for(self.seqs)
        self._may_end_with(self.seqs)
        self.sample_rows = SampleRows(self.seqs)

    def _set_columns(self, columns: np.ndarray) -> None:
        self.starts, self.deltas, self.pages, self.token_ids, self.tokens_left = columns.T.copy()

    def _may_end_with(self, seqs: list[Sequence]) -> None:
        ending = frozenset().union(*(seq.ending_tokens for seq in seqs))
        if ending and max(ending) + 2 > len(self.ending):
            self.ending = np.concatenate([self.ending[:-1], np.zeros(max(ending) + 3 - len(self.ending), dtype=bool)])
        self.ending[list(ending)] = True  # may only grow: a token that ends none is checked exactly, once

    def join(self, seqs: list[Sequence], mirror: BlockTableMirror) -> None:
        """Sequences that decode from this step on (imported ones admitted, their KV written; prompts
        whose last chunk just ran) become rows at the end; one the arrays cannot describe stays
        beside them."""
        seqs = [seq for seq in seqs if _decodes(seq)]
        if not seqs:
            return
        both = np.concatenate([np.stack([self.starts, self.deltas, self.pages, self.token_ids, self.tokens_left], 1),
                               np.array(_columns(seqs), dtype=np.int64)])
        self._set_columns(both)
        mirror.ensure_free(len(seqs))  # rows of their own: no row of this batch is taken
        self.rows = np.concatenate([self.rows, mirror.rows_for(seqs)])
        self.seqs = self.seqs + seqs
        self.ids.update(seq.seq_id for seq in seqs)
        self._may_end_with(seqs)
        self.sample_rows = self.sample_rows.joined(seqs)

    def leave(self, finished: list[Sequence]) -> None:
        """Sequences that finished (the scheduler freed them): their rows go."""
        if not finished:
            return
        gone = {seq.seq_id for seq in finished}
        keep = np.array([seq.seq_id not in gone for seq in self.seqs], dtype=bool)
        self.seqs = [seq for seq, kept in zip(self.seqs, keep.tolist()) if kept]
        self.ids -= gone
        for name in ("starts", "deltas", "pages", "token_ids", "tokens_left", "rows"):
            setattr(self, name, getattr(self, name)[keep])
        self.sample_rows = self.sample_rows.kept(keep)

    def synced(self, scheduler: Scheduler) -> None:
        """Every change to the running sequences this step made is in the arrays."""
        self.changes = scheduler.changes

    def take_pages(self, block_manager: BlockManager, mirror: BlockTableMirror) -> bool:
        """A page for each sequence whose token this step starts one -> False (and nothing taken)
        when the cache has too few free: the scheduler's general case preempts."""
        needing = np.flatnonzero(self.starts >= self.pages * self.block_size)
        if not len(needing):
            return True
        if len(needing) > block_manager.num_free_blocks:
            return False
        for i in needing.tolist():
            seq = self.seqs[i]
            block_manager.append_slots(seq)
            mirror.refresh(seq)
        self.pages[needing] += 1
        return True

    def advance(self, tokens: list[int], logprobs: dict[int, TokenLogprobs | None],
                block_manager: BlockManager) -> list[Sequence]:
        """The step's tokens (one per sequence, in order) are known: each sequence takes its own,
        full pages are published, and the sequences those tokens ended are returned (finished)."""
        seqs = self.seqs
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
            seq.num_computed_tokens += 1
        for i, row_logprobs in logprobs.items():  # rows past the batch's are other sequences'
            if row_logprobs is not None and i < len(seqs):
                seqs[i].output_logprobs.append(row_logprobs)
        self.starts = self.starts + 1
        self.token_ids = np.array(tokens, dtype=np.int64)
        self.tokens_left = self.tokens_left - 1
        if block_manager.enable_prefix_caching:
            for i in np.flatnonzero(self.starts % self.block_size == 0).tolist():  # the input's page is full
                block_manager.mark_computed(seqs[i])
        ending = self.ending
        may_end = (self.tokens_left <= 0) | ending[np.minimum(self.token_ids, len(ending) - 1)]
        return [seqs[i] for i in np.flatnonzero(may_end).tolist() if seqs[i].check_stop()]


def _decodes(seq: Sequence) -> bool:
    """A plain decode, which a row describes: one token to compute, known here, nothing else to wait on."""
    return len(seq.token_ids) - seq.num_computed_tokens == 1 and not seq.num_pending_tokens \
        and seq.inputs_ready_until is None and seq.imported_kv is None and seq.status is SequenceStatus.RUNNING


def _columns(seqs: list[Sequence]) -> list[tuple[int, int, int, int, int]]:
    """Each decoding sequence's (position of its input token, M-RoPE delta, pages, input token,
    tokens left before its length)."""
    return [(seq.num_computed_tokens, seq.mm.mrope_delta if seq.mm is not None else 0, len(seq.block_table),
             seq.token_ids[-1], seq.sampling_params.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens))
            for seq in seqs]
