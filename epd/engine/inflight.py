"""Async scheduling: a step's sampled tokens left on the device while the next step is scheduled,
prepared and launched (vLLM's async scheduling, SGLang's overlap scheduler).

Without it the host waits for every step's tokens before it schedules the next: on a GPU the device
then idles for the scheduler, the input preparation and the output bookkeeping of every step. With
it, step n+1 is launched first, its inputs that are step n's tokens filled in on the device from the
tensor step n sampled into; only then does the host wait, for step n's tokens alone (copied to
pinned memory behind an event), while step n+1 runs. A sequence that step n finished was scheduled
in step n+1 all the same: that row's work is wasted and its token dropped (``Scheduler.complete``).
"""
from __future__ import annotations

from itertools import repeat

import torch

from epd.engine.sequence import Sequence


class InflightTokens:
    """The tokens one step sampled, on the device: ``seqs[i]`` sampled ``tokens[i]``."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        self.seqs = seqs
        self.tokens = tokens
        self._row: dict[int, int] | None = None  # seq id -> row, made when a step needs it
        if tokens.is_cuda:  # the host's copy, queued behind the sampling: waited for in ``known``
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = tokens, None

    def fill(self, step) -> None:
        """Write the next step's inputs that are these tokens (``StepInputs.pending``), on the device."""
        pending, n = step.pending, len(self.seqs)
        if len(pending) == n and pending[-1][0] == n - 1 and [seq for _, seq in pending] == self.seqs:
            step.input_ids[:n].copy_(self.tokens)  # the usual decode step: the same rows, first, in order
            return
        if self._row is None:
            self._row = dict(zip((seq.seq_id for seq in self.seqs), range(n)))
        flat = torch.tensor([index for index, _ in pending], dtype=torch.long)
        rows = torch.tensor([self._row[seq.seq_id] for _, seq in pending], dtype=torch.long)
        device = step.input_ids.device
        step.input_ids[flat.to(device, non_blocking=True)] = self.tokens[rows.to(device, non_blocking=True)]

    def known(self) -> list[tuple[int, None]]:
        """The tokens on the host (waits for this step's sampling, not for anything launched after)."""
        if self._copied is not None:
            self._copied.synchronize()
        return list(zip(self._host.tolist(), repeat(None)))
