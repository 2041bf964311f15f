"""asyncio client: ``await AsyncEPDClient(address).chat(...)`` / ``async for d in client.stream(...)``."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc

from epd.client.errors import error_from_rpc
from epd.client.request import ImageInput, Messages, auth_metadata, build_request, retry_wait_s
from epd.client.types import ChatDelta, ChatResult, HealthStatus, ResultBuilder
from epd.v1 import common_pb2, router_pb2, router_pb2_grpc
from epd.wire.rpc import CHANNEL_OPTIONS


class AsyncChatStream:
    """Async iterator of ChatDelta for one request. ``await close()`` (or leaving the ``async with``
    block) before the end cancels the request on the server."""

    def __init__(self, start, address: str, *, max_retries: int = 0, timeout_s: float = 60.0) -> None:
        """``start()`` makes the call (again, for an overloaded retry: see ``ChatStream``)."""
        self._start, self._address, self._max_retries = start, address, max_retries
        self._deadline = time.monotonic() + timeout_s
        self._call = start()
        self._is_first, self._is_done = True, False
        self.num_retries = 0

    def __aiter__(self) -> AsyncChatStream:
        return self

    async def __anext__(self) -> ChatDelta:
        if self._is_done:
            raise StopAsyncIteration
        while True:
            try:
                msg = await self._call.read()
                break
            except grpc.RpcError as err:
                error = error_from_rpc(err, self._address)
                wait_s = retry_wait_s(error, self.num_retries, self._max_retries, self._deadline, time.monotonic()) \
                    if self._is_first else None
                if wait_s is None:
                    self._is_done = True
                    raise error from None
                await asyncio.sleep(wait_s)
                self.num_retries += 1
                self._call = self._start()
            except asyncio.CancelledError:  # the caller's task was cancelled: so is the request
                self.cancel()
                raise
        if msg is grpc.aio.EOF:
            self._is_done = True
            raise StopAsyncIteration
        delta = ChatDelta.from_proto(msg, is_first=self._is_first)
        self._is_first = False
        return delta

    def cancel(self) -> None:
        if not self._is_done:
            self._is_done = True
            self._call.cancel()

    async def close(self) -> None:
        self.cancel()

    aclose = close

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncEPDClient:
    """The asyncio twin of EPDClient. Use it from one event loop (the channel binds to it)."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, options: Sequence[tuple] = (),
                 api_key: str | None = None, max_retries: int = 2) -> None:
        self.address, self.timeout_s, self.max_retries = address, timeout_s, max_retries
        self._metadata = auth_metadata(api_key)
        self._options = [*CHANNEL_OPTIONS, *options]
        self._channel: grpc.aio.Channel | None = None
        self._stub_: router_pb2_grpc.RouterStub | None = None

    @property
    def _stub(self) -> router_pb2_grpc.RouterStub:
        # Created on first use, inside the caller's running loop.
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub_ = router_pb2_grpc.RouterStub(self._channel)
        return self._stub_

    async def chat(self, messages: Messages, *, images: Sequence[ImageInput] = (), timeout_s: float | None = None,
                   **options) -> ChatResult:
        """Run one request to the end (``options``: as ``EPDClient.chat``)."""
        builder = ResultBuilder()
        async with self.stream(messages, images=images, timeout_s=timeout_s, **options) as deltas:
            async for delta in deltas:
                builder.add(delta)
        return builder.result()

    def stream(self, messages: Messages, *, images: Sequence[ImageInput] = (), timeout_s: float | None = None,
               **options) -> AsyncChatStream:
        """Start one request (call from a running loop); ``async for`` the result for its deltas."""
        timeout_s = timeout_s or self.timeout_s
        request = build_request(messages, images=images, timeout_s=timeout_s, **options)
        return AsyncChatStream(lambda: self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata),
                               self.address, max_retries=self.max_retries, timeout_s=timeout_s)

    async def models(self, *, timeout_s: float | None = None) -> list[str]:
        response = await self._unary(self._stub.Models, router_pb2.ModelsRequest(), timeout_s)
        return [card.id for card in response.models]

    async def health(self, *, timeout_s: float | None = None) -> HealthStatus:
        return HealthStatus.from_proto(await self._unary(self._stub.Health, common_pb2.HealthRequest(), timeout_s))

    async def _unary(self, method, request, timeout_s: float | None):
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err, self.address) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncEPDClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
