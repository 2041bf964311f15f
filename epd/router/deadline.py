"""A request's deadline over the stream of its outputs: one timer for the whole request.

A timeout around each wait for the next output armed and disarmed a timer per token, a tenth of
the router's work per streamed token. Here the timer is armed once: when it fires while the
request waits for an output, it cancels that wait (the backend's cleanup runs as for any cancel)
and the wait raises ``DeadlineExceeded``; when it fires while the request is elsewhere (a front
end writing the previous output), the next wait raises at once. A cancel from anyone else (the
client went away) stays a cancel.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from epd.errors import DeadlineExceeded

T = TypeVar("T")
_CAN_UNCANCEL = hasattr(asyncio.Task, "uncancel")  # Python 3.11


class Deadline:
    def __init__(self, deadline: float, request_id: str) -> None:
        self.deadline, self.request_id = deadline, request_id
        self._task: asyncio.Task | None = None
        self._passed = self._cancelled = False
        self._cancelling = 0
        self._loop = asyncio.get_running_loop()  # asked once: asking again costs a getpid() each time (3.11)
        self._timer = self._loop.call_at(deadline, self._fire) if _CAN_UNCANCEL else None

    def _fire(self) -> None:
        self._passed = True
        if self._task is not None:  # waiting: that wait ends now
            self._cancelled = True
            self._task.cancel()

    async def next(self, outputs: AsyncIterator[T]) -> T | None:
        """The next output, None at the end; raises ``DeadlineExceeded`` once the deadline passed."""
        if not _CAN_UNCANCEL:
            return await _next_before(outputs, self.deadline, self.request_id)
        if self._passed:
            raise self._error()
        task = self._task = asyncio.current_task(self._loop)
        self._cancelling = task.cancelling()
        try:
            output = await outputs.__anext__()
        except StopAsyncIteration:
            output = None
        except asyncio.CancelledError:
            if self._cancelled and task.uncancel() <= self._cancelling:
                raise self._error() from None
            raise
        finally:
            self._task = None
        if self._cancelled:  # the output came as the timer fired, and the cancel was never delivered
            task.uncancel()
            raise self._error()
        return output

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _error(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"request {self.request_id} timed out")


async def _next_before(outputs: AsyncIterator[T], deadline: float, request_id: str) -> T | None:
    """Python 3.10: a timeout around each wait."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(outputs.__anext__(), max(0.0, deadline - loop.time()))
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise DeadlineExceeded(f"request {request_id} timed out") from None
