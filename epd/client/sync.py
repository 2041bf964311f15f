"""Blocking client: ``EPDClient(address).chat(...)`` / ``.stream(...)``."""
from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from epd.client.errors import error_from_rpc
from epd.client.request import ImageInput, Messages, auth_metadata, build_request, retry_wait_s
from epd.client.types import ChatDelta, ChatResult, HealthStatus, ResultBuilder
from epd.v1 import common_pb2, router_pb2, router_pb2_grpc
from epd.wire.rpc import CHANNEL_OPTIONS


class ChatStream:
    """Iterator of ChatDelta for one request. ``close()`` (or leaving the ``with`` block) before the
    end cancels the request on the server. A request the router refuses as overloaded before its
    first delta is sent again after the server's Retry-After, up to ``max_retries`` times within the
    deadline (as the openai client does)."""

    def __init__(self, start, address: str, *, max_retries: int = 0, timeout_s: float = 60.0) -> None:
        self._start, self._address, self._max_retries = start, address, max_retries
        self._deadline = time.monotonic() + timeout_s
        self._call = start()
        self._is_first, self._is_done = True, False
        self.num_retries = 0

    def __iter__(self) -> ChatStream:
        return self

    def __next__(self) -> ChatDelta:
        if self._is_done:
            raise StopIteration
        while True:
            try:
                msg = next(self._call)
                break
            except StopIteration:
                self._is_done = True
                raise
            except grpc.RpcError as err:
                error = error_from_rpc(err, self._address)
                wait_s = retry_wait_s(error, self.num_retries, self._max_retries, self._deadline, time.monotonic()) \
                    if self._is_first else None
                if wait_s is None:
                    self._is_done = True
                    raise error from None
                time.sleep(wait_s)
                self.num_retries += 1
                self._call = self._start()
        delta = ChatDelta.from_proto(msg, is_first=self._is_first)
        self._is_first = False
        return delta

    def close(self) -> None:
        if not self._is_done:
            self._is_done = True
            self._call.cancel()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # a stream dropped mid-way (break out of a for loop) should not run on in the server
            self.close()
        except Exception:
            pass


class EPDClient:
    """Talks to a router's public gRPC API. ``timeout_s`` is the default per-call deadline."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, options: Sequence[tuple] = (),
                 api_key: str | None = None, max_retries: int = 2) -> None:
        """``max_retries``: times a request the router refuses as overloaded is sent again (after
        its Retry-After, at most 10 s each, within the request's deadline)."""
        self.address, self.timeout_s, self.max_retries = address, timeout_s, max_retries
        self._metadata = auth_metadata(api_key)
        self._channel = grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, *options])
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def chat(self, messages: Messages, *, images: Sequence[ImageInput] = (), timeout_s: float | None = None,
             **options) -> ChatResult:
        """Run one request to the end. ``messages``: a prompt string or OpenAI-style messages;
        ``options``: ``build_request``'s (max_tokens, temperature, top_p, top_k, seed, stop, logprobs,
        the penalties, min_p, logit_bias, request_id)."""
        builder = ResultBuilder()
        with self.stream(messages, images=images, timeout_s=timeout_s, **options) as deltas:
            for delta in deltas:
                builder.add(delta)
        return builder.result()

    def stream(self, messages: Messages, *, images: Sequence[ImageInput] = (), timeout_s: float | None = None,
               **options) -> ChatStream:
        """Start one request; iterate the returned ChatStream for its deltas (``options``: as ``chat``)."""
        timeout_s = timeout_s or self.timeout_s
        request = build_request(messages, images=images, timeout_s=timeout_s, **options)
        return ChatStream(lambda: self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata),
                          self.address, max_retries=self.max_retries, timeout_s=timeout_s)

    def models(self, *, timeout_s: float | None = None) -> list[str]:
        response = self._unary(self._stub.Models, router_pb2.ModelsRequest(), timeout_s)
        return [card.id for card in response.models]

    def health(self, *, timeout_s: float | None = None) -> HealthStatus:
        return HealthStatus.from_proto(self._unary(self._stub.Health, common_pb2.HealthRequest(), timeout_s))

    def _unary(self, method, request, timeout_s: float | None):
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EPDClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
