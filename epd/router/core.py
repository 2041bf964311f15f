"""The router: admission, preprocessing, routing, and the E -> P -> D request path over grpc.aio.

Encoders get the request's media (grouped by the encoder each item routes to) and push embedding
handles straight to the chosen prefill worker; the decode worker gets the metadata and pulls the
first token and the KV from that prefill worker. The router streams tokens back and, when the
client goes away, cancels the request on every tier.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from epd.config import RouterConfig
from epd.models.qwen2_vl.processor import ProcessedPrompt, QwenVLInputProcessor
from epd.models.registry import family_for
from epd.models.tokenizer_loading import load_tokenizer
from epd.multimodal.media import MediaError
from epd.multimodal.messages import IMAGE_PART_TYPES, extract_images
from epd.protocol import logprobs_from_proto, multimodal_item, request_metadata
from epd.router.admission import AdmissionGate, RequestLimits
from epd.router.detok import IncrementalDetokenizer
from epd.router.metrics import RouterMetrics
from epd.router.routing import ROUTING_POLICIES
from epd.router.types import ChatRequest, RouterError, StreamEvent
from epd.router.workers import WorkerRegistry
from epd.v1 import common_pb2, decode_pb2, encoder_pb2

log = logging.getLogger("epd.router")
_PREFIX_KEY_TOKENS = 64  # how much of the prompt decides prefill affinity
_ENCODE_ATTEMPTS = 2


class Router:
    def __init__(self, model_dir: str | Path, config: RouterConfig) -> None:
        model_dir = Path(model_dir)
        self.config = config
        self.model_name = config.model
        self.tokenizer = load_tokenizer(model_dir)
        family = family_for(model_dir)
        spec = family.mm_spec(model_dir)
        self.processor = QwenVLInputProcessor(model_dir, self.tokenizer, spec, model_id=str(model_dir))
        # rows leave the encoder in its dtype; fp32 (4 bytes) is the encoder default
        self.limits = RequestLimits.from_config(config, spec.embedding_dim * 4)
        self.gate = AdmissionGate(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s)
        self.workers = WorkerRegistry({"encoder": list(config.encoders), "prefill": list(config.prefills),
                                       "decode": list(config.decodes)}, health_period_s=config.health_period_s)
        self.policies = {tier: ROUTING_POLICIES.get(getattr(config, f"{tier}_policy"))()
                         for tier in ("encoder", "prefill", "decode")}
        self.metrics = RouterMetrics()
        self.eos_token_ids = (self.tokenizer.eos_token_id,)

    async def start(self) -> None:
        await self.workers.start()

    async def close(self) -> None:
        await self.workers.close()

    # ---- RouterCore ---------------------------------------------------------------------------
    def health(self) -> dict:
        counts = self.workers.healthy_counts()
        ok = all(counts.get(t, 0) > 0 for t in ("encoder", "prefill", "decode"))
        return {"status": "ok" if ok else "degraded", "model": self.model_name,
                "workers": {t: [w.as_dict() for w in s] for t, s in self.workers.workers.items()}}

    def metrics_text(self) -> bytes:
        self.metrics.queue_depth.set(self.gate.num_queued)
        self.metrics.in_flight.set(self.gate.num_active)
        self.metrics.refresh_cluster(self.workers.workers)
        return self.metrics.render()

    async def generate(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        self.limits.check_num_items(count_images(request.messages))
        try:
            async with self.gate.slot():
                async for event in self._run(request):
                    yield event
        except RouterError as err:
            reason = {400: "never_fits", 429: "saturated", 503: "no_workers"}.get(err.status)
            if reason:
                self.metrics.rejections.labels(reason).inc()
            self.metrics.requests.labels(f"error_{err.status}").inc()
            raise

    # ---- the request path ---------------------------------------------------------------------
    async def _run(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        start = time.monotonic()
        prompt = await asyncio.to_thread(self._preprocess, request)
        self.limits.check_item_tokens([item.geometry.num_patches for item in prompt.items])
        self.limits.check_prompt(len(prompt.prompt_token_ids), sum(i.num_rows for i in prompt.items),
                                 request.sampling)
        prefill, decode = self._pick("prefill", _prefix_key(prompt)), self._pick("decode", request.request_id)
        timeout_s = request.timeout_s or self.config.request_timeout_s
        encode_errors: list[str] = []
        encodes = self._send_to_encoders(request.request_id, prompt, prefill, timeout_s, encode_errors)
        meta = request_metadata(request.request_id, prompt, request.sampling, self.eos_token_ids)
        call = self.workers.get("decode", decode).stub.Generate(
            decode_pb2.GenerateRequest(request=meta, prefill_address=prefill, kv_transport=self.config.transport),
            timeout=timeout_s)
        # hold the states themselves: a worker being drained stays reachable until we let go
        held = [self.workers.get("prefill", prefill), self.workers.get("decode", decode)]
        for worker in held:
            worker.in_flight += 1
        finished, first_at, num_tokens = False, None, 0
        detok = IncrementalDetokenizer(self.tokenizer)
        try:
            async for chunk in call:
                event = self._event(chunk, detok, prompt if first_at is None else None)
                if first_at is None:
                    first_at = time.monotonic()
                    self.metrics.observe_first_token(first_at - start, len(prompt.prompt_token_ids),
                                                     chunk.num_cached_tokens)
                num_tokens += len(chunk.token_ids)
                finished = bool(chunk.finish_reason)
                yield event
        except grpc.aio.AioRpcError as err:
            raise self._failure(err, decode, encode_errors) from None
        finally:
            for worker in held:
                worker.in_flight -= 1
            if not finished:
                await self._cancel(call, encodes, request.request_id, prefill)
        self.metrics.observe_done(start, first_at, num_tokens)

    def _preprocess(self, request: ChatRequest) -> ProcessedPrompt:
        return preprocess_chat(self.processor, request)

    def _event(self, chunk: decode_pb2.TokenChunk, detok: IncrementalDetokenizer,
               prompt: ProcessedPrompt | None) -> StreamEvent:
        text = detok.add(list(chunk.token_ids))
        if chunk.finish_reason:
            text += detok.flush()
        return StreamEvent(token_ids=list(chunk.token_ids), text=text,
                           logprobs=[logprobs_from_proto(lp) for lp in chunk.logprobs],
                           finish_reason=chunk.finish_reason or None,
                           prompt_token_ids=prompt.prompt_token_ids if prompt is not None else None,
                           num_cached_tokens=chunk.num_cached_tokens)

    def _pick(self, tier: str, key: str) -> str:
        candidates = self.workers.candidates(tier)
        if not candidates:
            raise RouterError(503, f"no healthy {tier} worker ({len(self.workers.workers[tier])} configured)",
                              error_type="service_unavailable")
        return self.policies[tier].pick(key, candidates)

    def _send_to_encoders(self, request_id: str, prompt: ProcessedPrompt, prefill: str, timeout_s: float,
                          errors: list[str]) -> list[asyncio.Task]:
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(prompt.items):
            groups.setdefault(self._pick("encoder", item.mm_hash), []).append(i)
        return [asyncio.create_task(self._encode(address, request_id, prompt, indices, prefill, timeout_s, errors))
                for address, indices in groups.items()]

    async def _encode(self, address: str, request_id: str, prompt: ProcessedPrompt, indices: list[int],
                      prefill: str, timeout_s: float, errors: list[str]) -> None:
        items = [multimodal_item(i, prompt.items[i], with_media=True) for i in indices]
        request = encoder_pb2.EncodeRequest(request_id=request_id, items=items, prefill_address=prefill,
                                            transport=self.config.transport)
        for attempt in range(_ENCODE_ATTEMPTS):
            worker = self.workers.get("encoder", address)
            worker.in_flight += 1
            try:
                await worker.stub.Encode(request, timeout=timeout_s)
                return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.CANCELLED:
                    return
                if err.code() == grpc.StatusCode.UNAVAILABLE and attempt + 1 < _ENCODE_ATTEMPTS:
                    # a restarted worker's first call can fail on the old connection; try again,
                    # on another encoder if one is healthy
                    others = [c for c in self.workers.candidates("encoder") if c.address != address]
                    address = self.policies["encoder"].pick(prompt.items[indices[0]].mm_hash, others) \
                        if others else address
                    continue
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    self.workers.mark_failed("encoder", address)
                errors.append(f"encoder {address}: {err.details()}")
                await self._abort_prefill(prefill, request_id, f"encoder {address} failed: {err.details()}")
                return
            finally:
                worker.in_flight -= 1

    async def _abort_prefill(self, prefill: str, request_id: str, reason: str) -> None:
        try:
            await self.workers.get("prefill", prefill).stub.Abort(
                common_pb2.AbortRequest(request_id=request_id, reason=reason), timeout=5)
        except grpc.aio.AioRpcError:
            pass  # prefill gone as well: the decode call fails on its own

    async def _cancel(self, call, encodes: list[asyncio.Task], request_id: str, prefill: str) -> None:
        """The client went away (or the stream failed): free the request on every tier."""
        call.cancel()
        for task in encodes:
            task.cancel()
        await self._abort_prefill(prefill, request_id, "cancelled by the client")

    def _failure(self, err: grpc.aio.AioRpcError, decode: str, encode_errors: list[str]) -> RouterError:
        if err.code() == grpc.StatusCode.UNAVAILABLE and "prefill" not in (err.details() or ""):
            self.workers.mark_failed("decode", decode)
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RouterError(504, f"request timed out: {err.details()}", error_type="timeout")
        detail = encode_errors[0] if encode_errors else err.details()
        status = 400 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 502
        return RouterError(status, f"request failed: {detail}", error_type="server_error" if status == 502
                           else "invalid_request_error")


def preprocess_chat(processor: QwenVLInputProcessor, request: ChatRequest) -> ProcessedPrompt:
    """Chat template, tokens, image geometry and hashes; bad media or prompts -> RouterError 400."""
    try:
        conv, images = extract_images(request.messages, allowed_local_root=None)
        return processor.process_messages(conv, images)
    except MediaError as err:
        raise RouterError(400, f"image: {err}", param="messages") from None
    except ValueError as err:
        raise RouterError(400, str(err), param="messages") from None


def count_images(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES)


def _prefix_key(prompt: ProcessedPrompt) -> str:
    head = prompt.prompt_token_ids[:_PREFIX_KEY_TOKENS]
    hashes = [i.mm_hash for i in prompt.items if i.offset < _PREFIX_KEY_TOKENS]
    return ",".join(map(str, head)) + "|" + ",".join(hashes)
