"""A request as the engine sees it: token ids, KV bookkeeping, sampling state (no torch)."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from enum import Enum, auto
from typing import Any

from epd.types import MultimodalItemSpan, SamplingParams, TokenLogprobs


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_seq_counter = itertools.count()


def stop_reason(params: SamplingParams, eos_token_ids: tuple[int, ...], num_output_tokens: int,
                last_token: int) -> str | None:
    """Why a request ends after emitting ``last_token`` as output number ``num_output_tokens``."""
    if num_output_tokens >= params.max_tokens:
        return "length"
    if num_output_tokens < params.min_tokens:
        return None
    if last_token in params.stop_token_ids or (not params.ignore_eos and last_token in eos_token_ids):
        return "stop"
    return None


class Sequence:
    """One request inside the engine.

    ``num_computed_tokens`` counts positions whose KV is in the cache; prefill chunks and
    prefix-cache hits advance it, preemption resets it. Multimodal payloads (embeddings,
    positions) ride in ``mm`` so the scheduler never has to know their types.
    """

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 request_id: str | None = None, mm_items: list[MultimodalItemSpan] | None = None,
                 mm: Any = None, eos_token_ids: tuple[int, ...] = (),
                 output_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token, got an empty prompt")
        self.seq_id = next(_seq_counter)
        self.request_id = request_id or f"req-{self.seq_id}"
        # outputs made elsewhere before (a migrated request): computed like the prompt, counted
        # as output, exactly as after a preemption by recompute
        self.token_ids: list[int] = list(prompt_token_ids) + list(output_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.mm_items = mm_items or []
        self.mm = mm
        self.eos_token_ids = eos_token_ids
        # every token that can end this request before its length does: one set lookup per step
        # tells a decode step that did not stop (stop_reason decides the rest, min_tokens included)
        self.ending_tokens = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids))
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # tokens sampled and not yet known here (async scheduling: a step's tokens stay on the device
        # while the next step is prepared and launched); they count in len(seq), not in token_ids
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table whose hashes are published (prefix cache)
        self.sample_kind: str | None = None  # how the sampler draws its rows, once it looked (sampler.sample_kind)
        self.sample_needs: tuple | None = None  # and what else it does for them (sampler._needs)
        # one entry per output token when logprobs are asked for: resumed outputs' were sent by the
        # worker that made them (None here), so the list stays aligned with the outputs
        self.output_logprobs: list[TokenLogprobs | None] = (
            [None] * len(output_token_ids) if sampling_params.logprobs is not None else [])
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the engine failed this sequence alone (its watcher is told)
        # set by a tier whose inputs arrive later (prefill waiting on encoder embeddings): returns
        # how far the prompt can be computed now (None: no limit)
        self.inputs_ready_until: Callable[[], int | None] | None = None
        # a prompt whose KV was computed elsewhere (decode): the KV to write into our blocks at
        # admission, and how many tokens to reserve so the request never needs preemption
        self.imported_kv: Any = None
        self.imported_kv_source: Any = None  # the handle it came from (a TensorHandle), when known
        self.num_reserved_tokens = 0
        # structured output: the grammar's matcher, fed every token this sequence samples (the engine
        # sets it at admission; epd.engine.grammar)
        self.grammar: Any = None
        self.grammar_error: str | None = None

    def __len__(self) -> int:
        """Positions the sequence occupies: its known tokens and those sampled but not known yet."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not yet cached: the prompt (or, after preemption, prompt+outputs)
        during prefill, exactly one during decode."""
        return len(self) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def schedulable_tokens(self, budget: int) -> int:
        """Tokens the next chunk may cover: within the budget and the inputs that have arrived."""
        n = min(self.num_uncomputed_tokens, budget)
        limit = self.inputs_ready_until() if self.inputs_ready_until is not None else None
        if limit is not None:
            n = min(n, limit - self.num_computed_tokens)
        return max(n, 0)

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = len(self) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self) -> bool:
        """Mark the sequence finished if its last token ends it; return whether it did."""
        tokens = self.token_ids
        num_output_tokens = len(tokens) - self.num_prompt_tokens
        if num_output_tokens < self.sampling_params.max_tokens and tokens[-1] not in self.ending_tokens:
            return False  # the common step: stop_reason would say None
        reason = stop_reason(self.sampling_params, self.eos_token_ids, num_output_tokens, tokens[-1])
        if reason is None:
            return False
        self.finish_reason = reason
        self.status = SequenceStatus.FINISHED
        return True

    @property
    def is_prompt_done(self) -> bool:
        """The whole prompt's KV is cached and the first output token sampled."""
        return self.num_output_tokens > 0 and self.num_computed_tokens >= self.num_prompt_tokens

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; the outputs so far become part of the prompt work.
        Multimodal inputs stripped after prefill are restored first (``mm.restore_for_recompute``)."""
        if self.imported_kv is not None or self.num_reserved_tokens:
            raise RuntimeError(f"{self.request_id}: a sequence with imported KV cannot be recomputed")
        if self.mm is not None:
            self.mm.restore_for_recompute()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table, self.num_hashed_blocks = [], 0
