"""A request's deadline over its outputs: one timer for the request, a wait it interrupts ends in
DeadlineExceeded (the stream's own cleanup run), a deadline that passed between waits ends the next
one, and a cancel from elsewhere stays a cancel."""
from __future__ import annotations

import asyncio

import pytest

from epd.errors import DeadlineExceeded
from epd.router.deadline import Deadline


class Outputs:
    """An output stream that gives ``count`` outputs at once, then hangs; it records its cleanup."""

    def __init__(self, count: int) -> None:
        self.count, self.closed_by = count, None

    async def stream(self):
        try:
            for i in range(self.count):
                yield i
            await asyncio.Event().wait()
        except BaseException as exc:
            self.closed_by = type(exc).__name__
            raise


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_the_deadline_interrupts_a_wait_and_the_stream_cleans_up():
    async def main():
        outputs = Outputs(3)
        stream = outputs.stream()
        timer = Deadline(asyncio.get_running_loop().time() + 0.2, "req-1")
        got = [await timer.next(stream) for _ in range(3)]
        with pytest.raises(DeadlineExceeded, match="request req-1 timed out"):
            await timer.next(stream)
        assert asyncio.current_task().cancelling() == 0  # the cancel it used is taken back
        return got, outputs.closed_by

    assert run(main()) == ([0, 1, 2], "CancelledError")


def test_a_deadline_that_passed_between_waits_ends_the_next_one():
    async def main():
        outputs = Outputs(5)
        stream = outputs.stream()
        timer = Deadline(asyncio.get_running_loop().time() + 0.05, "req-2")
        await timer.next(stream)
        await asyncio.sleep(0.2)  # the front end busy elsewhere when it passes
        with pytest.raises(DeadlineExceeded):
            await timer.next(stream)
        return outputs.closed_by

    assert run(main()) is None  # the stream was not touched: its owner closes it


def test_a_cancel_from_elsewhere_stays_a_cancel():
    async def main():
        timer = Deadline(asyncio.get_running_loop().time() + 30, "req-3")
        waiting = asyncio.ensure_future(timer.next(Outputs(0).stream()))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        timer.close()

    run(main())


def test_one_timer_for_the_whole_request_not_one_per_output():
    async def main():
        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at
        loop.call_at = lambda when, callback, *args, **kw: armed.append(when) or call_at(when, callback, *args, **kw)
        outputs = Outputs(200)
        stream = outputs.stream()
        timer = Deadline(loop.time() + 30, "req-4")
        for _ in range(200):
            await timer.next(stream)
        timer.close()
        await stream.aclose()
        return len(armed)

    assert run(main()) == 1


def test_an_output_that_came_as_the_timer_fired_still_ends_in_the_deadline_and_no_cancel_is_left():
    class Swallowing:
        """A backend whose wait returns its output even when cancelled (asyncio.wait_for does so
        when the result and the cancel meet)."""

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "late output"

    async def main():
        timer = Deadline(asyncio.get_running_loop().time() + 0.05, "req-5")
        with pytest.raises(DeadlineExceeded):
            await timer.next(Swallowing())
        return asyncio.current_task().cancelling()

    assert run(main()) == 0
