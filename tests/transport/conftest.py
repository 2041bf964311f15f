"""Transport tests: a leak check over /dev/shm for the whole session."""
from __future__ import annotations

import os

import pytest

from epd.transport import close_all, lease_renewer
from tests.transport.helpers import SPAWNED_PIDS, FakeClock, shm_names


def _made_by_us(name: str) -> bool:
    parts = name.split("_")
    return len(parts) >= 3 and parts[1].isdigit() and int(parts[1]) in SPAWNED_PIDS | {os.getpid()}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_segments():
    """Fails the session if any epd_ segment made by this test process or its children survives."""
    before = shm_names()
    yield
    lease_renewer().stop()  # the process-wide renewer some tests' imports started
    close_all()
    leaked = sorted(name for name in shm_names() - before if _made_by_us(name))
    for name in leaked:  # don't leave the garbage behind, even when failing
        os.unlink(os.path.join("/dev/shm", name))
    assert not leaked, f"transport tests leaked shared-memory segments: {leaked}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
