"""EngineLoop builds its engine on its own thread when given a factory (one thread runs every
torch op of a tier process) and reports a factory's failure to the caller of start()."""
import threading
import time

import pytest

from epd.engine.engine_loop import EngineLoop


class _IdleEngine:
    """What the loop touches of an idle engine."""

    has_unfinished = False
    num_steps = 0

    def __init__(self) -> None:
        self.built_on = threading.current_thread().name

    def step(self):
        raise AssertionError("an idle engine is never stepped")


def test_factory_runs_on_the_loop_thread_and_calls_run_there_too():
    loop = EngineLoop(lambda: _IdleEngine(), name="test-loop").start(timeout_s=10)
    try:
        assert loop.engine.built_on == "test-loop"
        assert loop.call(lambda engine: threading.current_thread().name).result(10) == "test-loop"
    finally:
        loop.stop()


def test_a_built_engine_is_used_as_is():
    engine = _IdleEngine()
    loop = EngineLoop(engine, name="test-loop").start(timeout_s=10)
    try:
        assert loop.engine is engine and engine.built_on == threading.current_thread().name
    finally:
        loop.stop()


def test_factory_error_reaches_start_and_the_thread_ends():
    def broken():
        raise ValueError("weights do not match the config")

    before = set(threading.enumerate())
    loop = EngineLoop(broken, name="test-loop")
    with pytest.raises(ValueError, match="weights do not match"):
        loop.start(timeout_s=10)
    loop.stop(timeout_s=5)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


class _WaitingEngine:
    """One sequence that waits on inputs until ``ready`` is set; counts every step."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.num_steps = 0
        self.num_step_calls = 0
        self.has_unfinished = True

    def step(self):
        self.num_step_calls += 1
        if self.ready.is_set():
            self.num_steps += 1
            self.has_unfinished = False
        return []


def test_a_loop_whose_sequences_wait_on_inputs_sleeps_until_woken():
    engine = _WaitingEngine()
    loop = EngineLoop(engine, name="test-loop").start(timeout_s=10)
    try:
        time.sleep(0.5)
        assert engine.num_step_calls == 1, "the loop must not poll while every sequence waits on inputs"
        engine.ready.set()
        loop.wake()
        deadline = time.monotonic() + 5
        while engine.num_steps == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_steps == 1 and engine.num_step_calls == 2
    finally:
        loop.stop()
