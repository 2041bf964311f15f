"""The decode worker: imports a request's KV from prefill into its paged cache and continues it
with continuous batching. Per request it holds token ids, sampling state and the mrope delta,
nothing multimodal (no pixels, embeddings or grids)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from epd.config import EngineConfig
from epd.engine.engine_loop import EngineLoop
from epd.engine.llm_engine import LLMEngine
from epd.engine.mm_inputs import SequenceMultimodal
from epd.engine.sampling_params import SamplingParams
from epd.engine.sequence import Sequence, TokenLogprobs
from epd.models.registry import family_for

_ADMIT_RETRY_S = 0.01


class DecodeError(RuntimeError):
    pass


class DecodeWorker:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig) -> None:
        model_dir = Path(model_dir)
        family = family_for(model_dir)
        # prefix caching buys nothing here: the KV arrives computed; recompute is impossible anyway
        cfg = engine_config if not engine_config.enable_prefix_caching else \
            EngineConfig(**{**engine_config.__dict__, "enable_prefix_caching": False})
        # built on the loop thread: one thread runs every torch op of this process (engine_loop)
        self.loop = EngineLoop(lambda: LLMEngine(family.load_llm(model_dir), cfg, eos_token_ids=()),
                               name="decode-loop").start()
        self.engine = self.loop.engine

    def close(self) -> None:
        self.loop.stop()

    def abort(self, request_id: str) -> bool:
        found = self.loop.call(lambda engine: engine.find(request_id)).result()
        if found is not None:
            self.loop.abort(found)
        return found is not None

    def start(self, request_id: str, prompt_token_ids: list[int], first_token: int,
              first_logprobs: TokenLogprobs | None, kv: torch.Tensor, mrope_delta: int,
              params: SamplingParams, eos_token_ids: tuple[int, ...], timeout_s: float):
        """Admit a prefilled request (its KV copied into our cache); returns (seq, update queue).
        Waits (bounded) for KV room: a decode worker never preempts, since it cannot recompute."""
        deadline = time.monotonic() + timeout_s
        while True:
            seq, updates = self.loop.add_and_watch(lambda engine: self._admit(
                engine, request_id, prompt_token_ids, first_token, first_logprobs, kv, mrope_delta, params,
                eos_token_ids))
            if seq is not None:
                return seq, updates
            if time.monotonic() > deadline:
                raise DecodeError(f"request {request_id}: no KV room within {timeout_s:.1f} s")
            time.sleep(_ADMIT_RETRY_S)

    def _admit(self, engine: LLMEngine, request_id, prompt_ids, first_token, first_logprobs, kv, delta,
               params, eos) -> Sequence | None:
        seq = Sequence(prompt_ids, params, request_id=request_id, mm=SequenceMultimodal.delta_only(delta),
                       eos_token_ids=eos)
        seq.append_token(first_token, first_logprobs)
        # reserve the whole budget now so this request never needs preemption
        if not engine.block_manager.allocate(seq, num_tokens=len(prompt_ids) + params.max_tokens):
            return None
        engine.runner.write_kv(seq.block_table, kv)
        seq.num_computed_tokens = len(prompt_ids)
        engine.scheduler.admit_running(seq)
        return seq
