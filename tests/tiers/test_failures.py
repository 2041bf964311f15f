"""Workers that die mid-service and are not restarted (no supervisor here): a request waits at most
the router's queue timeout for its tier to come back, then fails with a clear error naming the
tier; nothing hangs, the rest of the cluster keeps serving. With no move allowed
(``max_migrations=0``) the tier's own failure reaches the client at once."""
from __future__ import annotations

import signal
import time

import pytest

from epd.errors import EPDError
from epd.models.locate import resolve_model
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.transport import cleanup_stale_segments
from epd.types import SamplingParams
from tests.conftest import make_image_bytes
from tests.fidelity.reference import user_message

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster("tiny-qwen2-vl") as c:
        yield c


def kill(cluster, tier):
    proc = next(p for p in cluster.processes if p.tier == tier)
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    cleanup_stale_segments()  # what the tier's restart does first


def router(cluster, **config) -> SyncRouter:
    return SyncRouter.over_workers(resolve_model("tiny-qwen2-vl"), encoders=cluster.encoders,
                                   prefills=cluster.prefills, decodes=cluster.decodes, request_timeout_s=60,
                                   queue_timeout_s=3, **config)


def test_dead_encoder_fails_image_requests_fast_and_text_still_works(cluster):
    with router(cluster) as driver:
        assert driver.chat(user_message("warm up", [make_image_bytes(40, 40, seed=1)]), PARAMS).token_ids
        kill(cluster, "encoder")
        start = time.monotonic()
        with pytest.raises(EPDError, match="no healthy encoder worker"):
            driver.chat(user_message("Describe.", [make_image_bytes(50, 50, seed=2)]), PARAMS)
        assert time.monotonic() - start < 15, "a dead encoder must not leave the request waiting for its timeout"
        assert len(driver.chat(user_message("Text only.", []), PARAMS).token_ids) == 4


def test_dead_prefill_fails_requests_clearly(cluster):
    with router(cluster, max_migrations=0) as driver:
        assert driver.chat(user_message("warm up", []), PARAMS).token_ids
        kill(cluster, "prefill")
        start = time.monotonic()
        with pytest.raises(EPDError, match=r"prefill 127\.0\.0\.1:\d+ failed the request"):
            driver.chat(user_message("Text only.", []), PARAMS)
        assert time.monotonic() - start < 5, "no move allowed: the tier's failure is the answer"
    with router(cluster) as driver:
        start = time.monotonic()
        with pytest.raises(EPDError, match="no healthy prefill worker"):
            driver.chat(user_message("Text only.", []), PARAMS)
        assert time.monotonic() - start < 15
