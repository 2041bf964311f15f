"""Python SDK for the EPD router's gRPC API, blocking and asyncio.

    from epd.client import EPDClient
    with EPDClient("127.0.0.1:50051") as client:
        result = client.chat("What is in the picture?", images=["cat.png"], max_tokens=64)
        for delta in client.stream("Tell me a story", max_tokens=128):
            print(delta.text, end="")
"""
from epd.client.aio import AsyncChatStream, AsyncEPDClient
from epd.client.errors import DeadlineExceeded, EPDError, InvalidRequest, Overloaded, Unauthenticated, Unavailable
from epd.client.sync import ChatStream, EPDClient
from epd.client.types import ChatDelta, ChatResult, HealthStatus, TokenLogprob, ToolCall, Usage, WorkerHealth

__all__ = [
    "AsyncChatStream", "AsyncEPDClient", "ChatDelta", "ChatResult", "ChatStream", "DeadlineExceeded", "EPDClient",
    "EPDError", "HealthStatus", "InvalidRequest", "Overloaded", "TokenLogprob", "ToolCall", "Unauthenticated",
    "Unavailable",
    "Usage", "WorkerHealth",
]
