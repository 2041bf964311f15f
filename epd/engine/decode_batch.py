"""The decode batch kept from step to step (what vLLM calls its persistent batch).

While every running sequence is decoding and none joins or leaves, a step differs from the one
before in one way: each sequence is one token further. So its inputs are the last step's arrays
moved on by one (positions, the tokens just sampled, the same block-table rows), not read again
from every sequence, and what the step's tokens change is array arithmetic too: which sequences
filled a page (to publish for the prefix cache), which need a new one, which may have stopped.
What stays per sequence is what the sequences themselves hold: the token appended to its list
and its computed count (every other part of the engine, the tiers and a migration read them).

The batch is rebuilt from the scheduler's running list whenever that list changed
(``Scheduler.changes``) or a step ran without it (``invalidate``): a step that admits, prefills or
preempts is the scheduler's general case, and runs as one. Sequences the arrays cannot describe
(a token still on the device, inputs that arrive later, a KV still to import) leave it to the
general case too.
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
        self.changes = -1  # the scheduler's count of changes when the arrays were built
        self.stale = True
        self.starts = self.deltas = self.rows = self.pages = self.token_ids = self.tokens_left = np.zeros(0, np.int64)
        self.ending = np.zeros(1, dtype=bool)  # token id -> may end some sequence (the last entry: past every one)
        self.sample_rows: SampleRows | None = None

    def invalidate(self) -> None:
        """A step ran without this batch: the sequences moved on, the arrays did not."""
        self.stale = True

    def usable(self, scheduler: Scheduler, mirror: BlockTableMirror) -> bool:
        """Whether this step can run from the arrays: nothing waits to be admitted, every running
        sequence decodes, the token budget holds them all (rebuilt here when they changed)."""
        running = scheduler.running
        if scheduler.waiting or scheduler.importing or not running \
                or len(running) > scheduler.config.max_num_batched_tokens:
            return False
        if self.stale or self.changes != scheduler.changes:
            if not self._build(running, mirror):
                return False
            self.changes, self.stale = scheduler.changes, False
        return True

    def _build(self, running: list[Sequence], mirror: BlockTableMirror) -> bool:
        # the newest first: a sequence still prefilling is usually at the end, and ends the pass there
        columns = []
        for seq in reversed(running):
            computed, known = seq.num_computed_tokens, len(seq.token_ids)
            if known - computed != 1 or seq.num_pending_tokens or seq.inputs_ready_until is not None \
                    or seq.imported_kv is not None or seq.status is not SequenceStatus.RUNNING:
                return False
            columns.append((computed, seq.mm.mrope_delta if seq.mm is not None else 0, len(seq.block_table),
                            seq.token_ids[-1], seq.sampling_params.max_tokens - (known - seq.num_prompt_tokens)))
        columns.reverse()
        self.seqs = list(running)
        self.starts, self.deltas, self.pages, self.token_ids, self.tokens_left = np.array(columns, dtype=np.int64).T.copy()
        self.rows = mirror.rows_for(self.seqs)
        ending = frozenset().union(*(seq.ending_tokens for seq in self.seqs))
        self.ending = np.zeros(max(ending, default=-1) + 2, dtype=bool)
        self.ending[list(ending)] = True
        self.sample_rows = SampleRows(self.seqs)
        return True

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
        for i, row_logprobs in logprobs.items():
            if row_logprobs is not None:
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
