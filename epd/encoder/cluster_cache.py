"""The encoder engine's side of the cluster's encoder cache (``epd.encoder.shared_store``): for each
batch the scheduler picked, what the store already has (committed without a forward), what another
encoder is encoding right now (waited for, not encoded twice), and what this encoder must encode
(claimed first). Items waited for stay in flight in the engine's own cache; ``poll`` settles them
when their result lands in the store, or hands them back to encode when their claimant's lease ran
out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epd.encoder.cache import EncoderCacheKey
from epd.encoder.item_scheduler import ScheduledBatch, ScheduledItem
from epd.encoder.shared_store import Claim, SharedEncoderStore

POLL_S = 0.02  # how often items waited for are looked up while the engine has nothing else to do


@dataclass
class Split:
    found: ScheduledBatch = ScheduledBatch()  # items whose outputs came from the store
    outputs: list = field(default_factory=list)  # their outputs, in order
    encode: ScheduledBatch = ScheduledBatch()  # items to encode here


class ClusterCache:
    def __init__(self, store: SharedEncoderStore, *, width: int, dtype: torch.dtype, device: torch.device,
                 bytes_per_embedding: int) -> None:
        self.store = store
        self.width, self.dtype, self.device = width, dtype, device
        self.bytes_per_embedding = bytes_per_embedding
        self._claims: dict[EncoderCacheKey, Claim] = {}  # this encoder's, until shared
        self._awaiting: dict[EncoderCacheKey, tuple[ScheduledItem, Claim]] = {}  # another encoder's

    @property
    def waiting(self) -> bool:
        return bool(self._awaiting)

    def split(self, batch: ScheduledBatch) -> Split:
        found, outputs, encode = [], [], []
        for item in batch.items:
            tensor = self.store.fetch(item.cache_key, self._shape(item), self.dtype)
            if tensor is not None:
                found.append(item)
                outputs.append(self._on_device(tensor))
                continue
            claim = self.store.claim(item.cache_key, self.dtype)
            if claim is None or claim.mine:  # None: the store cannot say; encode here, unclaimed
                self._own(item, claim)
                encode.append(item)
            else:
                self._awaiting[item.cache_key] = (item, claim)
                self.store.counted_wait()
        return self._split(found, outputs, encode)

    def poll(self) -> Split:
        """The items waited for: those whose result is in the store now, and those to encode here
        (their claimant's lease ran out and this encoder took the claim over)."""
        found, outputs, encode = [], [], []
        for key, (item, claim) in list(self._awaiting.items()):
            outcome = self.store.poll(claim, self._shape(item), self.dtype)
            if outcome is None:
                continue
            if isinstance(outcome, Claim) and not outcome.mine:
                self._awaiting[key] = (item, outcome)  # another waiter took it over: wait on that one
                continue
            del self._awaiting[key]
            if isinstance(outcome, Claim):
                self._own(item, outcome)
                encode.append(item)
            else:
                found.append(item)
                outputs.append(self._on_device(outcome))
        return self._split(found, outputs, encode)

    def stop_waiting(self) -> ScheduledBatch:
        """Every item waited for, to encode here after all (the store cannot say how they are)."""
        items = [item for item, _ in self._awaiting.values()]
        self._awaiting.clear()
        return self._split([], [], items).encode

    def within_budgets(self, batch: ScheduledBatch, budgets) -> list[ScheduledBatch]:
        """``batch`` cut into batches the engine may run: at most ``encoder_batch_size`` items,
        ``encoder_max_num_tokens`` tokens and ``output_budget_bytes`` each (items taken over after a
        lease ran out come together, however many)."""
        parts, current = [], []
        for item in batch.items:
            trial = current + [item]
            if current and (len(trial) > budgets.encoder_batch_size
                            or sum(i.item.encoder_tokens for i in trial) > budgets.encoder_max_num_tokens
                            or sum(i.item.expected_rows for i in trial) * self.bytes_per_embedding
                            > budgets.output_budget_bytes):
                parts.append(current)
                trial = [item]
            current = trial
        if current:
            parts.append(current)
        return [self._split([], [], part).encode for part in parts]

    def share(self, batch: ScheduledBatch, cache) -> None:
        """What this engine encoded, for the cluster's other encoders (queued: nobody here waits for
        it), each with its claim, removed once the output is in the store."""
        for item in batch.items:
            claim = self._claims.pop(item.cache_key, None)
            entry = cache.get(item.cache_key)
            if entry is not None and entry.tensor is not None:
                tensor = entry.tensor  # a CUDA output is copied here, after the stream that wrote it
                self.store.put(item.cache_key, tensor.to("cpu") if tensor.is_cuda else tensor, claim)

    def forget(self, batch: ScheduledBatch) -> None:
        """A batch that failed: its claims run out on their own (a waiter takes over)."""
        for item in batch.items:
            self._claims.pop(item.cache_key, None)

    def _own(self, item: ScheduledItem, claim: Claim | None) -> None:
        if claim is not None:
            self._claims[item.cache_key] = claim

    def _shape(self, item: ScheduledItem) -> tuple[int, int]:
        return (item.item.expected_rows, self.width)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _split(self, found: list, outputs: list, encode: list) -> Split:
        rows = sum(i.item.expected_rows for i in encode)
        return Split(ScheduledBatch(tuple(found)), outputs,
                     ScheduledBatch(tuple(encode), sum(i.item.encoder_tokens for i in encode),
                                    rows * self.bytes_per_embedding))
