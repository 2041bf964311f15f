"""Deploy tests: short private temp dirs for Ray."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def short_tmp():
    """``short_tmp("ray")`` -> a new private directory directly under the system temp dir, removed
    with the module. Ray puts its sockets below its temp dir, and an AF_UNIX path must fit in 107
    bytes: pytest's own temp dirs (deeper still under xdist's ``popen-gwN``) leave too little."""
    made: list[str] = []

    def make(prefix: str) -> Path:
        made.append(tempfile.mkdtemp(prefix=f"epd-{prefix}-"))
        return Path(made[-1])

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
