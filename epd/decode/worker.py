"""The decode worker: takes requests prefilled elsewhere (first token + prompt KV), writes their KV
into its paged cache when their whole token budget fits, and continues them with continuous
batching. Per request it holds token ids, sampling state and the M-RoPE delta, nothing
multimodal (no pixels, embeddings or grids). It never preempts: it could not recompute a prompt
whose images it never saw, so a request waits (FIFO, no polling) until its budget fits."""
from __future__ import annotations

import functools
import queue
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from epd.config import EngineConfig
from epd.engine.engine_loop import EngineLoop
from epd.engine.llm_engine import LLMEngine
from epd.engine.memory_profile import with_model_len
from epd.engine.mm_inputs import SequenceMultimodal
from epd.engine.sequence import Sequence
from epd.engine.tensor_parallel import load_engine
from epd.engine.threads import ThreadPolicy
from epd.models.tokenizer_loading import load_tokenizer
from epd.wire.protocol import DecodeJob


class DecodeWorker:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig, *,
                 on_engine_lost: Callable[[str], None] | None = None) -> None:
        """``on_engine_lost(reason)``: called once when the engine can never step again (a
        tensor-parallel rank lost; ``EngineLoop``): the worker's process is to stop."""
        model_dir = Path(model_dir)
        # prefix caching buys nothing here: the KV arrives computed
        cfg = with_model_len(engine_config, model_dir).model_copy(update={"enable_prefix_caching": False})
        self.max_model_len = cfg.max_model_len  # what its health answer tells the routers
        # built on the loop thread: one thread runs every torch op of this process (engine_loop)
        self.loop = EngineLoop(lambda: load_engine(model_dir, cfg, (), lambda model: LLMEngine(
            model, cfg, eos_token_ids=(), load_tokenizer=functools.partial(load_tokenizer, model_dir))),
            name="decode-loop", threads=ThreadPolicy("decode", override=engine_config.num_threads),
            on_engine_lost=on_engine_lost).start()
        self.engine = self.loop.engine

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()

    def start(self, job: DecodeJob, kv: torch.Tensor, updates=None, kv_source=None
              ) -> tuple[Future, queue.SimpleQueue]:
        """Queue a prefilled request; -> (Future[Sequence] once it is queued on the engine, where the
        ``TokenUpdate``s for the tokens after the first go: ``updates``, default a thread queue).
        ``kv`` must stay readable until the first update arrives: it is copied into the cache at
        admission (``kv_source``: the handle it was imported from, held as long)."""
        updates = queue.SimpleQueue() if updates is None else updates
        added = self.loop.watch(lambda engine: engine.add_imported(
            job.prompt_token_ids, job.sampling, first_token_id=job.first_token_id,
            first_logprobs=job.first_logprobs, kv=kv, mm=SequenceMultimodal.delta_only(job.mrope_delta),
            eos_token_ids=job.eos_token_ids, request_id=job.request_id, output_token_ids=job.output_token_ids,
            kv_source=kv_source), updates)
        return added, updates

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        self.loop.abort(seq, reason)

    def abort_and_wait(self, seq: Sequence, timeout_s: float = 10.0) -> None:
        """Abort and return once the loop did it: a queued import no longer reads its KV after this."""
        self.abort_soon(seq).result(timeout_s)

    def abort_soon(self, seq: Sequence) -> Future:
        """Abort; -> a future done once the loop did it (calls run in order)."""
        self.loop.abort(seq, "cancelled")
        return self.loop.call(lambda engine: None)
