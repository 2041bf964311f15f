"""The engine: schedule -> execute -> sample -> update, one step at a time. Owns a model's paged KV
cache, its scheduler and sampler; tiers and ``epd.LLM`` drive it (through ``EngineLoop`` when
other threads submit work)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from epd.config import EngineConfig
from epd.engine.block_manager import BlockManager
from epd.engine.busy import BusyClock
from epd.engine.decode_batch import DecodeBatch
from epd.engine.decode_graphs import decode_batch_buckets
from epd.engine.grammar import GrammarCompiler
from epd.engine.inflight import InflightTokens
from epd.engine.memory_profile import check_holds_one_sequence, kv_blocks_for_device_memory
from epd.engine.mm_inputs import SequenceMultimodal
from epd.engine.model_runner import ModelRunner, local_heads
from epd.engine.sampler import Sampler
from epd.engine.scheduler import Scheduler, SchedulerConfig
from epd.engine.sequence import Sequence
from epd.errors import InvalidRequest
from epd.types import MultimodalItemSpan, SamplingParams


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, eos_token_ids: tuple[int, ...],
                 mm_token_ids: tuple[int, ...] = (), on_finish=None,
                 load_tokenizer: Callable[[], object] | None = None) -> None:
        """``load_tokenizer``: -> the model's tokenizer, for structured output (grammars are compiled
        against it; called at the first one); without it a request with structured output is refused."""
        self.grammar_compiler = GrammarCompiler(load_tokenizer, model.config.vocab_size) \
            if load_tokenizer is not None else None
        model_ranks = getattr(getattr(model, "tp", None), "size", 1)
        if config.tensor_parallel_size != model_ranks:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}, but the model was built for "
                             f"{model_ranks} rank(s) (epd.LLM starts the ranks; a worker runs one)")
        cfg = model.config
        dtype = config.torch_dtype
        bytes_per_token = 2 * cfg.num_hidden_layers * local_heads(model)[1] * cfg.head_dim * dtype.itemsize
        model = model.to(device=config.target_device, dtype=dtype)
        utilization = config.kv_gpu_memory_utilization
        if utilization is not None and config.target_device.startswith("cuda"):
            sized = config.model_copy(update={"gpu_memory_utilization": utilization})
            num_blocks = _smallest_of_ranks(model, kv_blocks_for_device_memory(model, sized, bytes_per_token,
                                                                               mm_token_ids))
            check_holds_one_sequence(num_blocks, config.block_size, config.max_model_len, utilization)
        else:
            num_blocks = _smallest_of_ranks(model, config.resolve_num_blocks(bytes_per_token))
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.max_model_len), self.block_manager,
                                   on_finish=on_finish)
        # tensor parallel: every rank must replay a step's collectives, so steps stay eager for now
        graph_sizes = () if config.enforce_eager or config.tensor_parallel_size > 1 else (
            config.cuda_graph_batch_sizes or tuple(decode_batch_buckets(config.max_num_seqs)))
        self.runner = ModelRunner(model, num_blocks=num_blocks,
                                  block_size=config.block_size, device=config.target_device, dtype=dtype,
                                  attention_backend=config.attention_backend, mm_token_ids=mm_token_ids,
                                  decode_graph_sizes=graph_sizes, max_model_len=config.max_model_len)
        self.sampler = Sampler()
        self.decode_batch = DecodeBatch(config.block_size)
        self.num_steps = 0
        self.busy = BusyClock()  # wall time inside step(): the engine's busy time (its utilization's numerator)
        self.num_batch_steps = 0  # steps run from the decode batch kept from the step before
        self.keep_decode_batch = True  # False: every step is the general one (benchmarks and tests compare)
        self.async_scheduling = config.async_scheduling
        self._inflight: InflightTokens | None = None  # the last step's tokens, still on the device
        self.num_overlapped_steps = 0  # steps launched while the one before had its tokens in flight

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    mm: SequenceMultimodal | None = None,
                    mm_items: list[MultimodalItemSpan] | None = None,
                    output_token_ids: tuple[int, ...] = ()) -> Sequence:
        """``output_token_ids``: what the request already produced elsewhere; it goes on after them."""
        self._check_vocabulary(params)
        seq = Sequence(prompt_token_ids, params, request_id=request_id, mm=mm, mm_items=mm_items,
                       eos_token_ids=self.eos_token_ids, output_token_ids=output_token_ids)
        seq.grammar = self._matcher(params, output_token_ids)
        self.scheduler.add(seq)
        return seq

    def _matcher(self, params: SamplingParams, output_token_ids) -> object | None:
        """The request's grammar matcher, fed what it produced already (a migrated request's
        outputs, an imported one's first token); compiled here, so a bad grammar fails alone."""
        if params.structured is None:
            return None
        if self.grammar_compiler is None:
            raise InvalidRequest("structured output needs the model's tokenizer, which this engine was built "
                                 "without", param="response_format")
        return self.grammar_compiler.matcher(params.structured, tuple(output_token_ids))

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Refuse a token id the model has no logit for now: in a step it would fail the batch."""
        vocab = self.runner.model.config.vocab_size
        for token_id, _ in params.logit_bias:
            if token_id >= vocab:
                raise InvalidRequest(f"logit_bias names token {token_id}; the model's vocabulary has {vocab}",
                                     param="logit_bias")

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        self.runner.block_tables.release(seq)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    def add_imported(self, prompt_token_ids: list[int], params: SamplingParams, *, first_token_id: int,
                     first_logprobs, kv, mm: SequenceMultimodal, eos_token_ids: tuple[int, ...],
                     request_id: str | None = None, output_token_ids: tuple[int, ...] = (),
                     kv_source=None) -> Sequence:
        """A request prefilled elsewhere: the KV ``kv`` ([layers, 2, tokens, kv_heads, head_dim]) of
        its prompt and of ``output_token_ids`` (tokens it produced before a migration) is written
        into our cache when it is admitted, with its whole token budget reserved. A KV of the wrong
        shape or dtype is refused here (ValueError), before it could fail a whole step.
        ``kv_source``: the handle ``kv`` was imported from (tensor-parallel ranks may read their
        heads there themselves); it must stay valid until the KV is written."""
        self.runner.check_kv(kv, len(prompt_token_ids) + len(output_token_ids))
        self._check_vocabulary(params)
        seq = Sequence(prompt_token_ids, params, request_id=request_id, mm=mm, eos_token_ids=eos_token_ids,
                       output_token_ids=output_token_ids)
        seq.grammar = self._matcher(params, (*output_token_ids, first_token_id))
        seq.append_token(first_token_id, first_logprobs)
        seq.imported_kv, seq.imported_kv_source = kv, kv_source
        self.scheduler.add_imported(seq, len(prompt_token_ids) + params.max_tokens)
        return seq

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel rank is lost or a step failed across the ranks."""
        ranks = self.runner.ranks
        return ranks is None or ranks.healthy

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (never raises; idempotent). Not while a step runs:
        from the thread that steps, or once it stopped."""
        if self.runner.ranks is not None:
            self.runner.ranks.close()

    def step(self) -> list[Sequence]:
        """One engine iteration; returns the sequences that finished in it. With async scheduling a
        step's tokens are known (appended, checked for stops) during the step after it."""
        self.busy.begin()
        try:
            return self._step()
        finally:
            self.busy.end()

    @property
    def step_seconds(self) -> float:
        """Wall seconds of the finished steps."""
        return self.busy.seconds

    def _step(self) -> list[Sequence]:
        if self.keep_decode_batch and not self.async_scheduling:
            finished = self._step_decode_batch()
            if finished is not None:
                return finished
        self.decode_batch.invalidate()
        out = self.scheduler.schedule()
        for seq in out.imported:
            self.runner.write_kv(seq.block_table, seq.imported_kv, seq.imported_kv_source)
            seq.imported_kv = seq.imported_kv_source = None
        inflight, self._inflight = self._inflight, None
        if out.is_empty:
            if inflight is not None:  # the last step's tokens, then whatever they let run
                finished = self.scheduler.complete(inflight.seqs, inflight.known())
                return finished + (self._step() if self.scheduler.has_unfinished else [])
            if self.scheduler.has_unfinished and out.num_waiting_on_inputs == 0:
                raise RuntimeError("scheduler made no progress: a waiting request cannot get KV blocks")
            return []
        logits, seqs = self.runner.execute(out, fill=inflight.fill if inflight is not None else None)
        self.scheduler.advance(out)
        finished = []
        if inflight is not None:  # this step runs on the device meanwhile
            self.num_overlapped_steps += 1
            finished = self.scheduler.complete(inflight.seqs, inflight.known())
        tokens = self.sampler.on_device(logits, seqs) if self.async_scheduling and seqs else None
        if tokens is not None:
            self._inflight = InflightTokens(seqs, tokens)
        else:  # a row needs the host (grammar, penalties, logprobs, a seed), or no async scheduling
            finished += self.scheduler.complete(seqs, self.sampler(logits, seqs))
        _strip_finished_prompts(out)
        for seq in finished:
            self.runner.block_tables.release(seq)
        self.num_steps += 1
        return finished

    def _step_decode_batch(self) -> list[Sequence] | None:
        """A step from the decodes kept as rows from the step before (imported sequences admitted
        among them), the other chunks scheduled beside them -> the sequences it finished, or None:
        the general step runs (no rows, a page or a prompt's room only a preemption would free)."""
        batch, scheduler, mirror = self.decode_batch, self.scheduler, self.runner.block_tables
        batch.refresh(scheduler, mirror)
        admitted = scheduler.admit_imported()
        for seq in admitted:  # running from here whatever step runs next: their KV goes in now
            self.runner.write_kv(seq.block_table, seq.imported_kv, seq.imported_kv_source)
            seq.imported_kv = seq.imported_kv_source = None
        batch.join(admitted, mirror)
        batch.synced(scheduler)
        if not batch.fits(scheduler) or not batch.take_pages(self.block_manager, mirror):
            return None
        out = scheduler.schedule_beside(batch.ids, len(batch.seqs))
        if out is None:
            return None
        logits, seqs = self.runner.execute(out, kept=batch)
        num_kept = len(batch.seqs)
        prompts = scheduler.advance(out)  # chunks beside the rows that sampled: their prompts are done
        rows = batch.sample_rows.joined(prompts) if prompts else batch.sample_rows
        tokens, logprobs = self.sampler.sample(logits, seqs, rows)
        finished = batch.advance(tokens[:num_kept], logprobs, self.block_manager)
        done = scheduler.complete(prompts, [(token, logprobs.get(num_kept + i))
                                            for i, token in enumerate(tokens[num_kept:])]) if prompts else []
        _strip_finished_prompts(out)
        scheduler.finish(finished)
        batch.leave(finished)
        batch.join(prompts, mirror)  # those still running decode from the next step on
        batch.synced(scheduler)
        for seq in finished + done:
            mirror.release(seq)
        self.num_steps += 1
        self.num_batch_steps += 1
        return finished + done

    def run_until_done(self, seqs: list[Sequence], max_steps: int = 1_000_000) -> list[Sequence]:
        for _ in range(max_steps):
            if all(s.is_finished for s in seqs):
                if self._inflight is not None and all(s.is_finished for s in self._inflight.seqs):
                    self.step()  # the last step launched served only these: take its tokens, leave nothing
                return seqs
            self.step()
        raise RuntimeError(f"requests did not finish within {max_steps} engine steps")


def _strip_finished_prompts(out) -> None:
    """Once a prompt's KV is cached, its multimodal inputs are dead weight: only the M-RoPE delta
    is needed to place later tokens, so everything else is dropped now (preemption restores it).
    A prompt served from the prefix cache is done at its first chunk, which may start past it."""
    for chunk in out.chunks:
        seq = chunk.seq
        if seq.mm is not None and chunk.end >= seq.num_prompt_tokens and not seq.mm.is_stripped:
            seq.mm.strip_for_generation()


def _smallest_of_ranks(model, num_blocks: int) -> int:
    """Rank 0's scheduler places every tensor-parallel rank's KV heads in the same pages: each rank
    takes as many as the one with the fewest (the ranks' devices may have different room)."""
    tp = getattr(model, "tp", None)
    return num_blocks if tp is None else tp.smallest(num_blocks)
