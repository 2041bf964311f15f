"""The transport of each hand-over follows where the two workers are: workers on one host (equal
``host_id``) hand tensors over in shared memory, workers on different hosts inline; the KV of a
request goes to a decode worker on prefill's host when there is one, and when that one is gone, to
another host inline. Real tier processes on this machine, each told which host it is on
(``--host-id``); output equals transformers through every placement."""
from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from epd.models.presets import write_preset_checkpoint
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.shm_owners import SHM_DIR, unlink_quietly
from epd.types import SamplingParams
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import wait_until
from tests.fidelity.reference import ReferenceModel
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=16)
IMG_A, IMG_B = make_image_bytes(120, 80, seed=61), make_image_bytes(70, 150, seed=62)
# text and images interleaved, one image twice
CHAT = [{"role": "user", "content": [
    {"type": "image", "image": IMG_A}, {"type": "text", "text": "and"}, {"type": "image", "image": IMG_B},
    {"type": "text", "text": "then"}, {"type": "image", "image": IMG_A}, {"type": "text", "text": "Compare them."}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("placement") / "ckpt", seed=4321)


@pytest.fixture(scope="module")
def expected(model_dir):
    return ReferenceModel(model_dir).generate(CHAT, [IMG_A, IMG_B, IMG_A], max_new_tokens=GREEDY.max_tokens)


def _metrics(process) -> str:
    return scrape(next(f.split("=", 1)[1] for f in process.ready_fields if f.startswith("metrics=")))


def _exported(process, transport: str) -> float:
    return sample_sum(_metrics(process), "epd_transfer_bytes_total", transport=transport, direction="export")


def _imported(process, **transport: str) -> float:
    return sample_sum(_metrics(process), "epd_transfer_bytes_total", direction="import", **transport)


def _handoffs(router, stage: str, placement: str) -> int:
    return router.pipeline.backend.handoffs[stage, placement]


def test_each_pair_gets_the_transport_of_where_it_is(model_dir, expected):
    """encoder on host a; prefill and one decode on host b; another decode on host c."""
    hosts = {"encoder": [("--host-id", "a")], "prefill": [("--host-id", "b")],
             "decode": [("--host-id", "b"), ("--host-id", "c")]}
    with LocalCluster(str(model_dir), num_decodes=2, worker_args=hosts) as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes, health_period_s=0.2) as router:
        by_host = {p.args[-1]: p for p in cluster.processes if p.tier == "decode"}
        encoder, prefill = (next(p for p in cluster.processes if p.tier == t) for t in ("encoder", "prefill"))
        workers = router.pipeline.backend.workers
        assert {w.host_id for w in workers.workers["decode"]} == {"b", "c"}  # as each said in its health

        for _ in range(3):  # least_loaded alone would use host c's decode too
            out = router.chat(CHAT, GREEDY)
            assert out.prompt_token_ids == expected.prompt_token_ids and out.token_ids == expected.token_ids
        # a -> b: the rows cross hosts inline; b -> b: the KV stays in shared memory, on host b's decode
        assert _exported(encoder, "inline") > 0 and _exported(encoder, "shm") == 0
        assert _exported(prefill, "shm") > 0 and _exported(prefill, "inline") == 0
        assert _imported(by_host["b"], transport="shm") > 0 and _imported(by_host["c"]) == 0
        assert _handoffs(router, "embeddings", "cross_host") > 0 and _handoffs(router, "embeddings", "same_host") == 0
        assert _handoffs(router, "kv", "same_host") == 3
        assert _handoffs(router, "kv", "cross_host") == 0

        # host b's decode goes: the KV goes to host c, inline, and the answer is the same
        by_host["b"].proc.send_signal(signal.SIGKILL)
        assert wait_until(lambda: [w.host_id for w in workers.workers["decode"] if w.healthy] == ["c"], 30)
        out = router.chat(CHAT, GREEDY)
        assert out.token_ids == expected.token_ids
        assert _exported(prefill, "inline") > 0
        assert _imported(by_host["c"], transport="inline") > 0 and _imported(by_host["c"], transport="shm") == 0
        assert _handoffs(router, "kv", "cross_host") == 1
        exposition = router.pipeline.metrics_text()
        assert sample_sum(exposition, "epd_tensor_handoffs_total", stage="kv", placement="cross_host") == 1


def test_a_configured_transport_still_wins(model_dir, expected):
    """--transport inline everywhere: no shared memory even between workers on one host."""
    with LocalCluster(str(model_dir), transport="inline") as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes) as router:
        out = router.chat(CHAT, GREEDY)
        assert out.token_ids == expected.token_ids
        prefill = next(p for p in cluster.processes if p.tier == "prefill")
        assert _exported(prefill, "inline") > 0 and _exported(prefill, "shm") == 0
        assert _handoffs(router, "kv", "same_host") == 1


def test_a_request_waits_for_a_restarting_tier_instead_of_a_503(model_dir, expected):
    """No decode worker in rotation (the tier is restarting, as when a node is lost): a request that
    comes meanwhile waits, within its queue budget, and is served once one is back."""
    with LocalCluster(str(model_dir)) as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes, health_period_s=0.2, queue_timeout_s=60) as router:
        workers = router.pipeline.backend.workers
        decode = next(p for p in cluster.processes if p.tier == "decode")
        decode.proc.send_signal(signal.SIGKILL)
        decode.proc.wait(10)
        assert wait_until(lambda: not workers.candidates("decode"), 10)
        outputs, errors = [], []

        def ask() -> None:
            try:
                outputs.append(router.chat(CHAT, GREEDY))
            except Exception as err:  # noqa: BLE001 - asserted below
                errors.append(err)

        asker = threading.Thread(target=ask)
        asker.start()
        asker.join(2.0)
        assert asker.is_alive() and not errors, errors  # waiting, not refused
        for _ in range(600):  # bounded: the decode worker is restarted, then the request finishes
            cluster.supervise(max_restarts=1)
            asker.join(0.2)
            if not asker.is_alive():
                break
        assert not asker.is_alive()
        assert not errors and outputs[0].token_ids == expected.token_ids


def test_a_request_moves_off_an_encoder_whose_rows_prefill_cannot_import(model_dir, expected):
    """An encoder whose memory prefill cannot map (here its owner lock is gone, so its segments read
    as a dead producer's) fails every request it serves. The request's move goes to the other
    encoder, although its images' content hashes route to that one, and the answer is the same;
    later requests pass the encoder over from the start."""
    with LocalCluster(str(model_dir), num_encoders=2, transport="shm") as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes, max_migrations=3) as router:
        backend = router.pipeline.backend
        bad = next(p for p in cluster.processes if p.tier == "encoder")
        policy = backend.policies["encoder"]
        routed = policy.pick
        # the images' hashes route to the bad encoder whenever it is a candidate
        policy.pick = lambda key, candidates: bad.address if any(c.address == bad.address for c in candidates) \
            else routed(key, candidates)
        assert router.chat(CHAT, GREEDY).token_ids == expected.token_ids  # served there, from its memory
        locks = [n for n in os.listdir(SHM_DIR) if re.fullmatch(rf"epd_{bad.proc.pid}_[0-9a-f]{{16}}", n)]
        assert len(locks) == 1, locks
        unlink_quietly(locks[0])

        out = router.chat(CHAT, GREEDY)
        assert out.prompt_token_ids == expected.prompt_token_ids and out.token_ids == expected.token_ids
        assert dict(backend.moves) == {"redispatched": 1}  # one move, away from the bad encoder
        # the next request passes it over from the start: no move
        assert router.chat(CHAT, GREEDY).token_ids == expected.token_ids
        assert dict(backend.moves) == {"redispatched": 1}
        passed_over = {w["address"]: w.get("passed_over_s", 0) for w in backend.health()["workers"]["encoder"]}
        assert passed_over[bad.address] > 0 and sum(passed_over.values()) == passed_over[bad.address]
