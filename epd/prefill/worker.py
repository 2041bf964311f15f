"""The prefill worker: no vision tower. It takes a request's metadata, waits for the encoders'
embedding pushes only when a chunk needs their rows, runs chunked prefill with prefix reuse,
samples the first token, exports the request's KV as a handle and keeps nothing multimodal."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from epd.config import EngineConfig
from epd.engine.engine_loop import EngineLoop
from epd.engine.llm_engine import LLMEngine
from epd.engine.mm_inputs import ItemRows, SequenceMultimodal
from epd.engine.sequence import Sequence, TokenLogprobs, stop_reason
from epd.models.registry import family_for
from epd.prefill.inbox import EmbeddingInbox
from epd.protocol import (cumsum_from_proto, embed_positions_from_cumsum, item_spans,
                          sampling_from_proto)
from epd.v1 import common_pb2

log = logging.getLogger(__name__)


class PrefillError(RuntimeError):
    pass


@dataclass
class PrefillResult:
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    kv: torch.Tensor  # [num_layers, 2, num_prompt_tokens, num_kv_heads, head_dim], a fresh copy
    mrope_delta: int
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None


class PrefillWorker:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig, *, overlap_with_encode: bool = True) -> None:
        model_dir = Path(model_dir)
        # True: text before the first image is prefilled while encoders still work (EPD's
        # overlap); False: a request waits for all its rows first
        self.overlap_with_encode = overlap_with_encode
        self.family = family_for(model_dir)
        self.spec = self.family.mm_spec(model_dir)
        self.inbox = EmbeddingInbox()
        self._exports: dict[int, torch.Tensor] = {}
        mm_ids = (self.spec.image_token_id, self.spec.video_token_id)
        # built on the loop thread: one thread runs every torch op of this process (engine_loop)
        self.loop = EngineLoop(lambda: LLMEngine(self.family.load_llm(model_dir), engine_config, eos_token_ids=(),
                                                 mm_token_ids=mm_ids, on_finish=self._export_kv),
                               name="prefill-loop").start()
        self.engine = self.loop.engine
        self.inbox.on_arrival = self.loop.wake
        self._closed = threading.Event()
        threading.Thread(target=self._sweep_inbox, name="prefill-inbox-sweeper", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self.loop.stop()

    def _sweep_inbox(self, period_s: float = 5.0) -> None:
        """Pushes whose request never came (router gone, request refused) release their leases."""
        while not self._closed.wait(period_s):
            self.inbox.sweep()

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Stop a request wherever it is (client gone, encoder failed); True if it was known.
        A prefill call waiting on it fails at once with ``reason``."""
        known = self.inbox.fail_request(request_id, reason)
        found = self.loop.call(lambda engine: engine.find(request_id)).result()
        if found is not None:
            self.loop.abort(found)
        return known or found is not None

    def prefill(self, meta: common_pb2.RequestMetadata, timeout_s: float) -> PrefillResult:
        """Blocking: returns once the first token is sampled and the KV is gathered."""
        params = sampling_from_proto(meta.sampling)
        eos = tuple(meta.eos_token_ids)
        rows = self.inbox.expect(meta.request_id, [item.expected_rows for item in meta.items]) if meta.items else None
        try:
            seq, updates = self.loop.add_and_watch(lambda engine: self._add(engine, meta, params, rows))
            update = self._wait_first_token(seq, updates, rows, timeout_s)
        finally:
            self.inbox.finish(meta.request_id)
        kv = self._exports.pop(seq.seq_id)
        first = update.token_ids[0]
        return PrefillResult(first, update.logprobs[0] if update.logprobs else None, kv,
                             seq.mm.mrope_delta if seq.mm else 0, seq.num_prompt_tokens, seq.num_cached_tokens,
                             stop_reason(params, eos, 1, first))

    def _add(self, engine: LLMEngine, meta, params, rows: ItemRows | None) -> Sequence:
        mm = self._multimodal(meta, rows)
        # prefill samples exactly one token; decode applies the request's real limits after it
        one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        seq = engine.add_request(list(meta.token_ids), one, request_id=meta.request_id, mm=mm,
                                 mm_items=item_spans(meta))
        if mm is not None and mm.embeddings is not None:
            rows = mm.embeddings
            seq.inputs_ready_until = mm.inputs_ready_until if self.overlap_with_encode else (
                lambda: None if rows.is_complete() else 0)
        return seq

    def _multimodal(self, meta: common_pb2.RequestMetadata, rows: ItemRows | None) -> SequenceMultimodal | None:
        if not meta.items:
            return None  # text only: positions are the token indices, delta 0
        items = [(item.offset, tuple(item.grid_thw)) for item in meta.items]
        positions, delta = self.family.mrope_positions(self.spec, len(meta.token_ids), items)
        cumsum = cumsum_from_proto(meta)
        return SequenceMultimodal(rows, embed_positions_from_cumsum(cumsum), cumsum, positions, delta)

    def _wait_first_token(self, seq: Sequence, updates, rows: ItemRows | None, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            error = rows.first_error() if rows is not None else None
            if error is not None:
                self.loop.abort(seq, reason="error")
                raise PrefillError(f"request {seq.request_id}: embeddings unavailable: {error}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.loop.abort(seq, reason="timeout")
                raise PrefillError(f"request {seq.request_id}: no first token within {timeout_s:.1f} s "
                                   f"({rows.num_ready_rows() if rows else 0} embedding rows arrived)")
            try:
                update = updates.get(timeout=min(remaining, 0.05))
            except Exception:  # queue.Empty: poll the encoder error again
                continue
            if update.error:
                raise PrefillError(f"request {seq.request_id}: {update.error}")
            if update.token_ids:
                return update

    def _export_kv(self, seq: Sequence) -> None:
        """Runs on the loop thread before the blocks are freed: copy out the prompt's KV, then
        strip everything multimodal but the mrope delta (seed §6.7)."""
        if seq.finish_reason == "abort" or seq.num_output_tokens == 0:
            return
        self._exports[seq.seq_id] = self.engine.runner.read_kv(seq.block_table, seq.num_prompt_tokens)
        if seq.mm is not None:
            seq.mm.strip_for_generation()
