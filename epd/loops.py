"""The event loop every EPD process runs its servers on: uvloop where it is installed (as uvicorn's
standard extras do), else asyncio's own.

Why: a router streaming tokens spends most of its CPU in the loop itself (one wake-up, one socket
read and one write per message); uvloop does that in C. Measured with
``benchmarks/control_plane.py --models null-qwen2-vl --topologies 1d --streams 1,64``: the router's
CPU per streamed token 0.28-0.32 -> 0.22-0.28 ms on one stream, 0.044 -> 0.037-0.040 at 64.
``EPD_EVENT_LOOP=asyncio`` picks asyncio's loop (to rule the loop out when chasing a bug).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
ENV_EVENT_LOOP = "EPD_EVENT_LOOP"


def _uvloop():
    if os.environ.get(ENV_EVENT_LOOP, "uvloop") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:  # not on this platform: asyncio's loop does the same, a little slower
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A loop for a thread of its own (a tier's gRPC server, the sync router)."""
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop."""
    if hasattr(asyncio, "Runner"):  # 3.11+
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main)
    loop = new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


def name() -> str:
    """The loop this process picks ("uvloop" or "asyncio"), for logs and tests."""
    return "uvloop" if _uvloop() is not None else "asyncio"


async def wait_for_future(future: concurrent.futures.Future, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a future another thread completes; -> whether it is done (its
    outcome stays on ``future``). The asyncio future that waits for it has its own outcome read
    here: a failure nobody read from it would be logged, traceback and all, when it is collected."""
    waited = asyncio.wrap_future(future)
    waited.add_done_callback(lambda f: f.cancelled() or f.exception())
    done, _ = await asyncio.wait({waited}, timeout=max(0.0, timeout_s))
    return bool(done)
