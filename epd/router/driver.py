"""Takes one request through E -> P -> D over gRPC: the router's request path without admission,
HTTP or health tracking (the router builds on this).

Preprocessing needs the tokenizer and the image headers only, never model weights. Items go to
encoders by content hash (the same image always reaches the encoder that has it cached); one
request's items may be spread over several encoders and come back in order at prefill, which
matches them by item index.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import grpc

from epd.engine.sampling_params import SamplingParams
from epd.llm import RequestOutput
from epd.models.registry import family_for
from epd.models.tokenizer_loading import load_tokenizer
from epd.models.qwen2_vl.processor import ProcessedPrompt, QwenVLInputProcessor
from epd.multimodal.messages import extract_images
from epd.protocol import logprobs_from_proto, multimodal_item, request_metadata
from epd.transport import get_channel
from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, encoder_pb2, encoder_pb2_grpc, prefill_pb2_grpc


class RequestFailed(RuntimeError):
    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class ClusterDriver:
    def __init__(self, model_dir: str | Path, *, encoders: list[str], prefills: list[str], decodes: list[str],
                 transport: str = "", allowed_local_media_path: str | None = None, timeout_s: float = 120.0) -> None:
        if not (encoders and prefills and decodes):
            raise ValueError(f"need at least one worker per tier, got {len(encoders)} encoders, "
                             f"{len(prefills)} prefills, {len(decodes)} decodes")
        model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        spec = family_for(model_dir).mm_spec(model_dir)
        self.processor = QwenVLInputProcessor(model_dir, self.tokenizer, spec, model_id=str(model_dir))
        self.encoders, self.prefills, self.decodes = encoders, prefills, decodes
        self.transport, self.timeout_s = transport, timeout_s
        self.allowed_local_media_path = allowed_local_media_path
        self._next = 0

    # ---- public ---------------------------------------------------------------------------------
    def chat(self, messages: list[dict], params: SamplingParams, request_id: str | None = None) -> RequestOutput:
        tokens, logprobs, finish, prompt = [], [], None, None
        for chunk, prompt in self.stream(messages, params, request_id):
            tokens += chunk.token_ids
            logprobs += [logprobs_from_proto(lp) for lp in chunk.logprobs]
            finish = chunk.finish_reason or finish
        return RequestOutput(request_id or "", prompt.prompt_token_ids, tokens,
                             self.tokenizer.decode(tokens, skip_special_tokens=True), finish, logprobs)

    def stream(self, messages: list[dict], params: SamplingParams,
               request_id: str | None = None) -> Iterator[tuple[decode_pb2.TokenChunk, ProcessedPrompt]]:
        request_id = request_id or uuid.uuid4().hex
        conv, images = extract_images(messages, allowed_local_root=self.allowed_local_media_path)
        prompt = self.processor.process_messages(conv, images)
        prefill, decode = self._pick(self.prefills), self._pick(self.decodes)
        encodes = self._send_to_encoders(request_id, prompt, prefill)
        for future in encodes:  # an encoder that fails must not leave prefill waiting for rows
            future.add_done_callback(lambda f: self._abort_on_failure(f, request_id, prefill))
        meta = request_metadata(request_id, prompt, params, (self.tokenizer.eos_token_id,))
        stub = decode_pb2_grpc.DecodeStub(get_channel(decode))
        call = stub.Generate(decode_pb2.GenerateRequest(request=meta, prefill_address=prefill,
                                                        kv_transport=self.transport), timeout=self.timeout_s)
        try:
            for chunk in call:
                yield chunk, prompt
        except grpc.RpcError as err:
            raise RequestFailed(self._explain(err, encodes), err.code()) from None
        finally:
            call.cancel()  # no-op when finished; frees every tier when the caller stops early

    # ---- helpers --------------------------------------------------------------------------------
    def _send_to_encoders(self, request_id: str, prompt: ProcessedPrompt, prefill: str) -> list[Future]:
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(prompt.items):
            groups.setdefault(self.encoders[int(item.mm_hash[:15], 16) % len(self.encoders)], []).append(i)
        futures = []
        for address, indices in groups.items():
            items = [multimodal_item(i, prompt.items[i], with_media=True) for i in indices]
            stub = encoder_pb2_grpc.EncoderStub(get_channel(address))
            futures.append(stub.Encode.future(encoder_pb2.EncodeRequest(
                request_id=request_id, items=items, prefill_address=prefill, transport=self.transport),
                timeout=self.timeout_s))
        return futures

    def _abort_on_failure(self, future: Future, request_id: str, prefill: str) -> None:
        err = future.exception()
        if err is None:
            return
        reason = f"encoder failed: {err.details() if hasattr(err, 'details') else err}"
        try:
            prefill_pb2_grpc.PrefillStub(get_channel(prefill)).Abort(
                common_pb2.AbortRequest(request_id=request_id, reason=reason), timeout=10)
        except grpc.RpcError:
            pass  # prefill is gone too; the decode call fails on its own

    @staticmethod
    def _explain(err: grpc.RpcError, encodes: list[Future]) -> str:
        """Prefer the encoder's own error: prefill only knows that the rows never came."""
        for future in encodes:
            if future.done() and future.exception() is not None:
                enc = future.exception()
                return f"encoder failed: {enc.details() if hasattr(enc, 'details') else enc}"
        return err.details() or str(err.code())

    def _pick(self, addresses: list[str]) -> str:
        self._next += 1
        return addresses[self._next % len(addresses)]
