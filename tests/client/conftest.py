from __future__ import annotations

import pytest

from epd.router.media_fetch import MediaFetcher
from tests.client.fakes import FakeCore, RouterServerThread


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    return tmp_path_factory.mktemp("media-root")


@pytest.fixture(scope="module")
def served(media_root):
    core = FakeCore(MediaFetcher(allowed_local_media_path=str(media_root)))
    with RouterServerThread(core) as server:
        yield server


@pytest.fixture
def core(served) -> FakeCore:
    served.core.reset()
    return served.core


@pytest.fixture
def address(served, core) -> str:  # every test starts from a fresh script
    return served.address
