"""The event loop EPD's processes run on (epd.loops): uvloop when installed, asyncio's on request."""
import asyncio

import pytest

from epd import loops

uvloop = pytest.importorskip("uvloop")


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_run_and_threads_loops_are_uvloop(monkeypatch):
    monkeypatch.delenv(loops.ENV_EVENT_LOOP, raising=False)
    assert loops.name() == "uvloop"
    assert issubclass(loops.run(_loop_type()), uvloop.Loop)
    loop = loops.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_env_picks_asyncio(monkeypatch):
    monkeypatch.setenv(loops.ENV_EVENT_LOOP, "asyncio")
    assert loops.name() == "asyncio"
    loop_type = loops.run(_loop_type())
    assert not issubclass(loop_type, uvloop.Loop) and issubclass(loop_type, asyncio.BaseEventLoop)
