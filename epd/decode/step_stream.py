"""The decode tier's side of a router's stream: many requests on one gRPC stream, one message per
engine step for all of them.

A router keeps one ``Stream`` call per decode worker. It starts requests and cancels them by
command; the engine loop thread publishes each request's new tokens into the stream's ``StepSink``,
which hands the step's updates to the event loop in one call once the step is done, and they go out
as one ``StepBatch``. Per token that is one list append on the loop thread; per step one wake-up of
the event loop and one message, however many requests the stream carries (the per-request streams
before cost a wake-up and a message for every request in every step).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from epd.engine.async_updates import UpdateBatch
from epd.engine.engine_loop import TokenUpdate


class StepSink(UpdateBatch):
    """Where the engine loop thread puts the updates of one stream's requests; ``flush`` (once per
    step, on that thread) hands the step's (request id, update) pairs to ``deliver`` on the event
    loop, in one call, with the step's plain tokens as two columns (request ids, tokens) once
    ``columns`` is set (the router reads them: ``StreamCommand.token_columns``): a decode step's
    usual output, one token for each request, then costs no object per request on either side."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 deliver: Callable[[list[tuple[str, TokenUpdate]], list[str], list[int]], None]) -> None:
        super().__init__(loop, deliver)
        self.columns = False  # set before the first request is watched; a router sends the same with every start
        # a stream whose steps the engine thread may send itself (``DirectSteps``), or None
        self.direct: DirectSteps | None = None
        self._keys: list[str] = []
        self._tokens: list[int] = []

    def updates_for(self, request_id: str, interval: int = 1) -> "RequestUpdates":
        return RequestUpdates(self, request_id, interval)

    def add_token(self, request_id: str, token: int) -> None:
        self._keys.append(request_id)
        self._tokens.append(token)

    def flush(self) -> None:
        if not (self._pending or self._keys):
            return
        pending, keys, tokens = self._pending, self._keys, self._tokens
        self._pending, self._keys, self._tokens = [], [], []
        direct = self.direct
        if direct is not None:
            if not pending and direct.send_columns(keys, tokens):
                return  # out already: the event loop does not wake for this step
            direct.owe()  # until ``deliver`` ran, no later step overtakes it
        self._hand_over(pending, keys, tokens)


class DirectSteps(Protocol):
    """A stream whose plain steps the engine loop's thread sends itself. A step that only carries
    plain tokens costs the event loop nothing then: no wake-up, no hand-over of the interpreter
    between the two threads (on one stream that ping-pong cost the worker more CPU than the step's
    own bookkeeping). Anything else (a first token, a finish, logprobs, an error) goes to the loop,
    which owns the requests' state, and the steps after it wait until it went out."""

    def send_columns(self, keys: list[str], tokens: list[int]) -> bool:
        """(engine thread) The step's plain tokens out now -> False: hand them to the loop."""

    def owe(self) -> None:
        """(engine thread) A step goes to the loop; its ``deliver`` says when it is out."""


@dataclass(eq=False)
class RequestUpdates:
    """One request's ``updates`` for ``EngineLoop.watch``: its updates go into the shared ``batch``."""

    batch: StepSink
    request_id: str
    # its router's --stream-interval: its plain tokens after the first of this worker go out once a
    # group of that many is complete (``EngineLoop._publish_step`` holds them in the sequence)
    interval: int = 1

    @property
    def batch_key(self) -> str:
        """What the batch's items carry with each update (the sink's ``deliver`` splits by it)."""
        return self.request_id

    def put(self, update: TokenUpdate) -> None:
        self.batch.add((self.request_id, update))


@dataclass(eq=False)
class StreamRequest:
    """One request on a stream, for its cleanup: what it holds and how far it got."""

    request_id: str
    task: asyncio.Task | None = None
    added: Future | None = None  # of the sequence, once the engine loop queued it
    imported: object = None  # the KV import (ImportedTensor)
    held: object = None  # its bytes in the worker's admission (HeldBytes)
    kv_written: bool = False  # an update came: the KV is in the cache, the import is free
    finished: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
