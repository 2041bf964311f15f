"""EPD on a Ray cluster of four nodes on this one machine (Ray's own ``ray.cluster_utils.Cluster``),
each node on its own loopback address with a custom resource: the router on the head (127.0.0.5),
the encoder on 127.0.0.2, prefill and decode packed on one of 127.0.0.3 / 127.0.0.4.

The head is not on 127.0.0.1 on purpose: Ray rewrites 127.0.0.1 / localhost in a connect address
to the machine's interface address, which a test must not contact; elsewhere in 127.0.0.0/8 every
connection stays on loopback. Any loopback address is bindable from any process here, so the test
asserts what each actor advertises, not only that requests work.

Checked: every actor serves on its own node's address; an image chat (text and images interleaved,
one image twice) equals transformers; the rows cross nodes inline and the KV stays in shared memory
on its node; killing the prefill/decode node's raylet under streaming clients costs no request (the
actors come back on the other node, the launcher registers them, every stream equals its fault-free
answer); at the end no actor process and no shared-memory segment is left.
"""
from __future__ import annotations

import base64
import time
from pathlib import Path

import openai
import pytest
import ray

from epd.shm_owners import is_stale
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import wait_until
from tests.procs import gone

pytestmark = pytest.mark.slow

HEAD, ENCODER_NODE, PD_NODES = "127.0.0.5", "127.0.0.2", ("127.0.0.3", "127.0.0.4")
IMG_A, IMG_B = make_image_bytes(96, 64, seed=71), make_image_bytes(64, 120, seed=72)
MAX_TOKENS = 12


def _shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("epd_*")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from epd.models.presets import write_preset_checkpoint
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("multinode") / "ckpt", seed=9090)


@pytest.fixture(scope="module")
def ray_cluster(short_tmp):
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")  # no token auth inside the test's own cluster
        # Cluster() records its address under $RAY_TMPDIR/ray whatever temp_dir says: keep that private too
        private_tmp = short_tmp("raytmp")
        (private_tmp / "ray").mkdir()
        env.setenv("RAY_TMPDIR", str(private_tmp))
        cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": HEAD, "num_cpus": 1, "resources": {"router_node": 1}, "include_dashboard": False,
            "temp_dir": str(short_tmp("ray")),
            # a dead raylet is noticed in ~2 s instead of ~30 s
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4}})
        try:
            nodes = {ENCODER_NODE: cluster.add_node(node_ip_address=ENCODER_NODE, num_cpus=1,
                                                    resources={"encoder_node": 1})}
            for address in PD_NODES:
                nodes[address] = cluster.add_node(node_ip_address=address, num_cpus=1, resources={"pd_node": 1})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, _node_ip_address=HEAD, log_to_driver=False)
            yield cluster, nodes
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture(scope="module")
def epd(ray_cluster, model_dir):
    from epd.config import RayDeployment, RouterConfig, TierSpec
    from epd.server.ray import RayEPDCluster

    shm_before = _shm_segments()
    pd = TierSpec(num_cpus=0.5, resources={"pd_node": 0.5}, max_restarts=3)
    deployment = RayDeployment(
        model=str(model_dir), host="node", http_port=0, grpc_port=0, colocate_prefill_decode=True,
        router_resources={"router_node": 1}, router=RouterConfig(queue_timeout_s=120.0),
        tiers={"encoder": TierSpec(num_cpus=0.5, resources={"encoder_node": 1}, max_restarts=3),
               "prefill": pd, "decode": pd})
    c = RayEPDCluster(deployment)
    pids: set[int] = set()
    try:
        c.start(timeout_s=300)
        c.wait_healthy(180)
        c.pids = pids  # every actor process seen, checked gone at the end
        yield c
    finally:
        c.stop()
    assert wait_until(lambda: all(gone(p) for p in pids), 60), [p for p in pids if not gone(p)]
    # what is new since the start and belongs to no live process: ours, left behind (a segment of a
    # live process belongs to whatever else runs on this machine, another test module included)
    left = {name for name in _shm_segments() - shm_before if is_stale(name) or any(
        name.startswith(f"epd_{pid}_") for pid in pids)}
    assert not left, left


def _note_pids(epd) -> None:
    epd.pids.update(ray.get([a.pid.remote() for tier in epd.actors.values() for a in tier], timeout=120))


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].removeprefix("http://")


def test_every_actor_serves_on_its_own_node(epd):
    _note_pids(epd)
    assert [_host(a) for a in epd.addresses["encoder"]] == [ENCODER_NODE]
    (prefill,), (decode,) = epd.addresses["prefill"], epd.addresses["decode"]
    assert _host(prefill) == _host(decode) and _host(prefill) in PD_NODES  # packed on one node
    assert _host(epd.http_url) == _host(epd.grpc_address) == HEAD
    # each worker's host, as the router learned it from the worker, is its Ray node
    health = epd.health()
    for tier in ("encoder", "prefill", "decode"):
        assert [w["host_id"] for w in health["workers"][tier]] == epd.nodes[tier]
    assert epd.nodes["encoder"] != epd.nodes["prefill"] == epd.nodes["decode"]


def test_an_image_chat_across_nodes_equals_transformers(epd, model_dir):
    from tests.fidelity.reference import ReferenceModel
    from tests.prom import sample_sum, scrape

    def url(image: bytes) -> dict:
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}

    content = [url(IMG_A), {"type": "text", "text": "and"}, url(IMG_B), {"type": "text", "text": "then"},
               url(IMG_A), {"type": "text", "text": "Compare them."}]
    client = openai.OpenAI(base_url=f"{epd.http_url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=str(model_dir), max_tokens=MAX_TOKENS, temperature=0,
                                         messages=[{"role": "user", "content": content}],
                                         extra_body={"return_token_ids": True})
    reference_messages = [{"role": "user", "content": [
        {"type": "image", "image": IMG_A}, {"type": "text", "text": "and"}, {"type": "image", "image": IMG_B},
        {"type": "text", "text": "then"}, {"type": "image", "image": IMG_A}, {"type": "text", "text": "Compare them."}]}]
    ref = ReferenceModel(model_dir).generate(reference_messages, [IMG_A, IMG_B, IMG_A], max_new_tokens=MAX_TOKENS)
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids

    # the rows crossed nodes inline; the KV stayed on its node, in shared memory
    router = scrape(f"{epd.http_url}/metrics")
    assert sample_sum(router, "epd_tensor_handoffs_total", stage="embeddings", placement="cross_host") >= 3
    assert sample_sum(router, "epd_tensor_handoffs_total", stage="embeddings", placement="same_host") == 0
    assert sample_sum(router, "epd_tensor_handoffs_total", stage="kv", placement="same_host") >= 1
    encoder = scrape(ray.get(epd.actors["encoder"][0].metrics_url.remote(), timeout=30))
    assert _host(ray.get(epd.actors["encoder"][0].metrics_url.remote(), timeout=30).split("/metrics")[0]) == \
        ENCODER_NODE
    assert sample_sum(encoder, "epd_transfer_bytes_total", transport="inline", direction="export") > 0
    assert sample_sum(encoder, "epd_transfer_bytes_total", transport="shm", direction="export") == 0
    prefill = scrape(ray.get(epd.actors["prefill"][0].metrics_url.remote(), timeout=30))
    assert sample_sum(prefill, "epd_transfer_bytes_total", transport="shm", direction="export") > 0


def test_a_node_lost_under_streams_costs_no_request(epd, ray_cluster):
    from epd.bench.chaos import LoopingClients, chats, mismatches, references

    cluster, nodes = ray_cluster
    _note_pids(epd)
    model = epd.d.model
    chat_list = chats(max_tokens=16)
    refs = references(epd.http_url, model, chat_list)
    lost = _host(epd.addresses["prefill"][0])
    other = next(a for a in PD_NODES if a != lost)
    with LoopingClients(epd.http_url, model, chat_list, num_clients=3, timeout_s=240) as clients:
        deadline = time.monotonic() + 120
        while clients.num_ok < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        done = clients.num_ok
        cluster.remove_node(nodes[lost], allow_graceful=False)  # its raylet and everything on it, at once
        # back, on the other node, and registered by the launcher
        assert wait_until(lambda: [_host(a) for a in epd.addresses["prefill"] + epd.addresses["decode"]] ==
                          [other, other], 240)
        health = epd.wait_healthy(240)
        while clients.num_ok < done + 6 and time.monotonic() < deadline + 360:
            time.sleep(0.2)
    assert not clients.failures(), [f"{o.status} {o.error}" for o in clients.failures()][:5]
    assert not mismatches(clients.snapshot(), refs)
    assert clients.num_ok >= done + 6
    for tier in ("prefill", "decode"):
        assert [_host(w["address"]) for w in health["workers"][tier]] == [other], health["workers"][tier]
    assert [_host(a) for a in epd.addresses["encoder"]] == [ENCODER_NODE]  # untouched
    _note_pids(epd)
