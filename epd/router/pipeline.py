"""The router's one request pipeline, for both front ends and any backend:

    admit -> resolve media -> preprocess -> check limits -> run on the backend -> detokenize,
    stop strings, metrics -> stream events

The front ends (HTTP, public gRPC) only translate to ``ChatRequest`` and from ``StreamEvent``; the
backend (the tiers over gRPC, or the whole model in this process) only runs prepared jobs. This
is the one place that owns a request from arrival to its last byte.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from epd.config import ConfigError, RouterConfig
from epd.errors import UNDECODABLE_MARKER, EPDError, InvalidRequest
from epd.models.generation_config import GenerationConfigError, generation_defaults
from epd.models.registry import family_for
from epd.models.spec import ProcessedPrompt
from epd.models.tokenizer_loading import load_tokenizer
from epd.multimodal.messages import extract_media, media_parts, modality_of, part_location
from epd.router.admission import AdmissionGate, RequestLimits
from epd.router.backends.base import Backend, BackendOutput, Job
from epd.router.deadline import Deadline
from epd.router.detok import IncrementalDetokenizer
from epd.router.media_fetch import FetchLimits, MediaFetcher
from epd.router.metrics import RouterMetrics
from epd.router.stop_strings import StopStrings
from epd.router.token_groups import TokenGroups
from epd.router.tool_calls import ToolCallStream
from epd.types import ChatRequest, SamplingParams, StreamEvent

log = logging.getLogger("epd.router")


class RequestPipeline:
    """A ``RouterCore`` (what the front ends call) over one ``Backend``."""

    def __init__(self, model_dir: str | Path, config: RouterConfig, backend: Backend, *,
                 media: MediaFetcher | None = None) -> None:
        model_dir = Path(model_dir)
        self.config = config
        self.served_model_names = config.served_model_name or (config.model,)
        self.model_name = self.served_model_names[0]
        self.backend = backend
        self.tokenizer = load_tokenizer(model_dir)
        if config.chat_template:  # --chat-template: a file, or the template itself
            path = Path(config.chat_template).expanduser()
            self.tokenizer.chat_template = path.read_text() if path.is_file() else config.chat_template
        self.processor = family_for(model_dir).input_processor(model_dir, self.tokenizer)
        try:  # the server's own kwargs are checked once, against the checkpoint, before any request
            self.processor.media_settings(config.mm_processor_kwargs)
        except ValueError as err:
            raise ConfigError(f"mm_processor_kwargs: {err}") from None
        try:  # the checkpoint's sampling defaults and EOS ids (vLLM's --generation-config auto)
            self.generation = generation_defaults(model_dir, config.generation_config)
        except GenerationConfigError as err:
            raise ConfigError(str(err)) from None
        if changed := self.generation.changed():
            log.info("sampling defaults from %s: %s (--generation-config vllm turns them off)",
                     self.generation.source, changed)
        own = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        self.eos_token_ids = own + tuple(t for t in dict.fromkeys(self.generation.eos_token_ids) if t not in own)
        self.media = media or MediaFetcher(limits=FetchLimits(max_items=config.max_items_per_request))
        self.limits = RequestLimits.from_config(config, backend.embedding_row_bytes)
        self.gate = AdmissionGate(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s)
        self.metrics = RouterMetrics(self.model_name, config.router_index)

    async def start(self) -> None:
        await self.backend.start()

    async def close(self) -> None:
        await self.backend.close()

    # ---- RouterCore -----------------------------------------------------------------------------
    def health(self) -> dict:
        return {"model": self.model_name,
                "router": {"index": self.config.router_index, "host": socket.gethostname(), "pid": os.getpid()},
                **self.backend.health()}

    def metrics_text(self) -> bytes:
        self.refresh_metrics()
        return self.metrics.render()

    def refresh_metrics(self) -> None:
        """The metrics read from elsewhere (admission, the workers' health, the backend's counts) brought up to now."""
        self.metrics.queue_depth.set(self.gate.num_queued)
        self.metrics.in_flight.set(self.gate.num_active)
        self.backend.refresh_metrics(self.metrics)

    async def generate(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        """Stream a request's events; raises ``EPDError`` before the first event for what admission
        refuses (400, 429, 503) and during the stream for failures. Closing the iterator early
        cancels the request on the backend."""
        start = time.monotonic()
        deadline = start + (request.timeout_s or self.config.request_timeout_s)  # the queue wait counts too
        try:
            self.limits.check_num_items(count_media_parts(request.messages))
            async with self.gate.slot():
                prompt = await self._prepare(request)
                runs = self._run(request, prompt, start, deadline) if request.n == 1 else \
                    self._run_choices(request, prompt, start, deadline)
                async for event in runs:
                    yield event
        except EPDError as err:
            self.metrics.observe_error(err)
            raise

    # ---- the request path -----------------------------------------------------------------------
    async def _run_choices(self, request: ChatRequest, prompt: ProcessedPrompt, start: float,
                           deadline: float) -> AsyncIterator[StreamEvent]:
        """``n`` choices of one prompt, their events merged (each with its ``index``). Choice 0 runs
        first; the others start once its first token is out, so the prompt's KV is in prefill's
        prefix cache and the images' rows in the encoders' cache: they share the prefill and the
        encoding. A seeded request's choice i draws with seed + i (else the choices would be equal)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            params = request.sampling
            if params.seed is not None and index:
                params = dataclasses.replace(params, seed=params.seed + index)
            try:
                async for event in self._run(request, prompt, start, deadline, sampling=params, tag=f"c{index}"):
                    event.index = index
                    await queue.put(event)
                await queue.put((index, None))
            except BaseException as err:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((index, err))

        tasks = [asyncio.create_task(pump(0))]
        try:
            finished = 0
            while finished < request.n:
                item = await queue.get()
                if isinstance(item, tuple):
                    if item[1] is not None:
                        raise item[1]
                    finished += 1
                    continue
                if len(tasks) == 1:  # choice 0's first output: its prefix is cached now
                    tasks += [asyncio.create_task(pump(i)) for i in range(1, request.n)]
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, request: ChatRequest, prompt: ProcessedPrompt, start: float, deadline: float, *,
                   sampling: SamplingParams | None = None, tag: str = "") -> AsyncIterator[StreamEvent]:
        # the client's id, made unique for the workers: two requests with one id never meet there
        job = Job(f"{request.request_id}#{tag}{uuid.uuid4().hex[:8]}", prompt, sampling or request.sampling,
                  self.eos_token_ids, deadline)
        text = _TextStream(self.tokenizer, request.stop_strings, request.include_stop_str_in_output,
                           request.sampling.stop_token_ids, request.parse_tool_calls)
        if self.config.enable_log_requests:
            log.info("request %s: %s", job.request_id, _received(prompt, job.sampling))
        outputs = self.backend.run(job)
        timer = Deadline(deadline, request.request_id)
        groups = TokenGroups(self.config.stream_interval)
        first_at, num_tokens, finish = None, 0, "cancelled"
        try:
            while True:
                try:
                    output = await timer.next(outputs)
                except InvalidRequest as err:
                    raise name_the_part(err, prompt, request.messages) from None
                ended = output is None  # the backend's outputs ended: what is held goes out
                # --stream-interval: held until its group is due
                output = groups.flush() if ended else groups.take(output, first=first_at is None)
                if output is None:
                    if ended:
                        break
                    continue
                event = text.event(output, prompt if first_at is None else None)
                if first_at is None:
                    first_at = time.monotonic()
                    self.metrics.observe_first_token(first_at - start, len(prompt.prompt_token_ids),
                                                     output.num_cached_tokens)
                num_tokens += len(event.token_ids)
                self.metrics.output_tokens += len(event.token_ids)  # as they stream: rates stay smooth
                yield event
                if event.finish_reason:
                    finish = event.finish_reason
                    break
                if ended:
                    break
        finally:
            timer.close()
            await outputs.aclose()  # before the last output: cancels the request wherever it is
        self.metrics.observe_done(start, first_at, num_tokens)
        if self.config.enable_log_requests:
            ttft = f"{1000 * (first_at - start):.0f} ms" if first_at is not None else "none"
            log.info("request %s: finished (%s), %d tokens, TTFT %s, %.2f s", job.request_id,
                     finish, num_tokens, ttft, time.monotonic() - start)

    async def prompt_of(self, request: ChatRequest, *, add_generation_prompt: bool = True) -> ProcessedPrompt:
        """The prompt ``request`` runs with: media resolved, chat template applied (or a raw prompt
        tokenized), each image expanded to its rows (what /tokenize counts)."""
        self.limits.check_num_items(count_media_parts(request.messages))
        if request.prompt is not None:
            return await asyncio.to_thread(self._raw_prompt, request.prompt)
        processor_kwargs = self._processor_kwargs(request)  # before any media is fetched
        messages = await self.media.resolve(request.messages)
        return await asyncio.to_thread(self._preprocess, messages, request.tools, add_generation_prompt,
                                       request.chat_template_kwargs, processor_kwargs)

    def _processor_kwargs(self, request: ChatRequest) -> dict | None:
        """The server's ``mm_processor_kwargs`` with the request's on top, checked against the
        checkpoint (a 400 naming the field)."""
        merged = {**self.config.mm_processor_kwargs, **(request.mm_processor_kwargs or {})}
        try:
            self.processor.media_settings(merged)
        except ValueError as err:
            raise InvalidRequest(f"mm_processor_kwargs: {err}", param="mm_processor_kwargs") from None
        return merged or None

    @property
    def request_timeout_s(self) -> float:
        return self.config.request_timeout_s

    @property
    def max_model_len(self) -> int:
        self._follow_the_engines()
        return self.limits.max_model_len

    def _follow_the_engines(self) -> None:
        """A router given no ``max_model_len`` admits by what its engines take: the smallest of its
        prefill and decode workers' (each decides its own where it runs: on CUDA by default the
        checkpoint's length), or the in-process engine's; the default until they answer."""
        if "max_model_len" in self.config.model_fields_set:
            return
        length = getattr(self.backend, "engine_max_model_len", lambda: None)()
        if length and length != self.limits.max_model_len:
            self.limits = dataclasses.replace(self.limits, max_model_len=length)

    def detokenize(self, token_ids: list[int]) -> str:
        vocab = len(self.tokenizer)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"tokens must be in [0, {vocab}), got {bad}", param="tokens")
        return self.tokenizer.decode(token_ids)

    async def _prepare(self, request: ChatRequest) -> ProcessedPrompt:
        prompt = await self.prompt_of(request)
        self._follow_the_engines()
        self.limits.check_item_tokens([(item.modality, item.geometry.num_patches) for item in prompt.items])
        if request.fill_max_tokens:
            request.sampling = self.limits.fill_max_tokens(len(prompt.prompt_token_ids), request.sampling)
        self.limits.check_prompt(len(prompt.prompt_token_ids), prompt.num_embedding_rows, request.sampling)
        return prompt

    def _raw_prompt(self, prompt: str | list[int]) -> ProcessedPrompt:
        """A completions prompt: its text tokenized as it is (or its token ids), no chat template."""
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)
        vocab = len(self.tokenizer)
        if not ids:
            raise InvalidRequest("the prompt is empty; expected text or token ids", param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab}), got {bad}", param="prompt")
        try:
            return self.processor.process_token_ids(list(ids), [])
        except ValueError as err:
            raise InvalidRequest(str(err), param="prompt") from None

    def _preprocess(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None,
                    processor_kwargs: dict | None = None) -> ProcessedPrompt:
        """Chat template, ids, each image's geometry and hash; a bad prompt is a 400."""
        conversation, media = extract_media(messages)
        try:
            return self.processor.process_messages(conversation, media, tools=tools,
                                                   add_generation_prompt=add_generation_prompt,
                                                   template_kwargs=template_kwargs, processor_kwargs=processor_kwargs)
        except EPDError:
            raise
        except ValueError as err:
            raise InvalidRequest(str(err), param="messages") from None
        except Exception as err:  # noqa: BLE001 - a template that fails on this conversation (jinja raises many)
            raise InvalidRequest(f"the chat template failed on these messages: {type(err).__name__}: {err}",
                                 param="messages") from None


class _TextStream:
    """Backend outputs -> events: incremental text, then stop strings (which may end the request)."""

    def __init__(self, tokenizer, stop_strings: list[str], include_stop_str: bool = False,
                 stop_token_ids: tuple[int, ...] = (), parse_tool_calls: bool = False) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStrings(stop_strings, include_in_output=include_stop_str)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tools = ToolCallStream() if parse_tool_calls else None

    def event(self, output: BackendOutput, prompt: ProcessedPrompt | None) -> StreamEvent:
        text, matched, output = self._through_stops(output)
        finish_reason = "stop" if matched is not None else output.finish_reason
        stop_reason: str | int | None = matched
        if finish_reason and matched is None:
            text += self.stops.flush()
            last = output.token_ids[-1] if output.token_ids else None
            if finish_reason == "stop" and last in self.stop_token_ids:
                stop_reason = last  # a stop token ended it; EOS leaves stop_reason None, as vLLM
        calls = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if finish_reason:
                text += self.tools.flush()
                if finish_reason == "stop" and self.tools.calls:
                    finish_reason = "tool_calls"  # OpenAI's reason when the answer is calls
        return StreamEvent(token_ids=list(output.token_ids), text=text, logprobs=list(output.logprobs),
                           finish_reason=finish_reason, stop_reason=stop_reason, tool_calls=calls,
                           prompt_token_ids=list(prompt.prompt_token_ids) if prompt is not None else None,
                           num_cached_tokens=output.num_cached_tokens if prompt is not None else 0)


    def _through_stops(self, output: BackendOutput) -> tuple[str, str | None, BackendOutput]:
        """The output's text past the stop strings -> (text, the stop met or None, the output). A
        stop met inside an output of several tokens (a reader that lagged gets its tokens in one
        piece) ends it at the token that completed the match, as one token at a time would: the
        tokens, logprobs and usage a client sees never depend on how its tokens were batched."""
        if len(output.token_ids) <= 1 or not self.stops.stops:
            text, matched = self.stops.feed(self.detok.add(output.token_ids))
            return text, matched, output
        pieces = []
        for i, token_id in enumerate(output.token_ids):
            text, matched = self.stops.feed(self.detok.add([token_id]))
            pieces.append(text)
            if matched is not None:
                return "".join(pieces), matched, dataclasses.replace(
                    output, token_ids=output.token_ids[:i + 1], logprobs=output.logprobs[:i + 1])
        return "".join(pieces), None, output


def count_media_parts(messages: list[dict]) -> dict[str, int]:
    """Media parts by modality."""
    return dict(Counter(modality_of(part) for _, _, part in media_parts(messages)))


def name_the_part(err: InvalidRequest, prompt: ProcessedPrompt, messages: list[dict]) -> InvalidRequest:
    """An encoder's bad-input error names each image by its content hash (it knows no request's
    messages): say which of this request's parts they were, ``messages[i].content[j]``, each with
    its cause (an image sent twice names both its parts)."""
    parts_by_hash: dict[str, list[str]] = {}
    for item, (i, j, _) in zip(prompt.items, media_parts(messages)):
        parts_by_hash.setdefault(item.mm_hash, []).append(part_location(i, j))
    found = sorted((err.message.find(marker), marker, where) for mm_hash, where in parts_by_hash.items()
                   if (marker := f"{UNDECODABLE_MARKER} {mm_hash}): ") in err.message)
    if not found:
        return err
    named = []
    for n, (at, marker, where) in enumerate(found):
        end = found[n + 1][0] if n + 1 < len(found) else len(err.message)
        named.append(f"{', '.join(where)}: {err.message[at + len(marker):end].rstrip('; ')}")
    return InvalidRequest("; ".join(named), param=found[0][2][0])


def _received(prompt: ProcessedPrompt, sampling: SamplingParams) -> str:
    """A request as the request log shows it: sizes and sampling, never its text or images (a log
    line must not leak what users send)."""
    kinds = [item.modality for item in prompt.items]
    media = ", ".join(f"{kinds.count(k)} {k}{'s' if kinds.count(k) > 1 else ''}" for k in dict.fromkeys(kinds))
    return (f"{len(prompt.prompt_token_ids)} prompt tokens{f' ({media})' if media else ''}, "
            f"max_tokens={sampling.max_tokens}, temperature={sampling.temperature}, top_p={sampling.top_p}, "
            f"top_k={sampling.top_k}, seed={sampling.seed}")
