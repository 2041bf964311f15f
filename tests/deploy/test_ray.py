"""EPD on a local Ray cluster (127.0.0.1, private temp dir, shut down at the end), its prefill a
tensor-parallel worker of two ranks: a multimodal request through the HTTP API; a killed worker actor is restarted by Ray on a new port and the
launcher registers it with the router again; a decode
actor killed under streaming clients costs no request (they migrate, token for token); a tier
scales up (new worker registers with the router) and down (drained first). Every process talks
mutual TLS (the deployment's one ``tls`` block, certificates made here): a plain client is refused."""
from __future__ import annotations

import base64
import threading
import time

import openai
import pytest
import ray

from tests.conftest import make_image_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, short_tmp):
    from epd.config import EngineConfig, RayDeployment, TierSpec, TlsConfig, WorkerConfig
    from epd.server.ray import RayEPDCluster
    from tests.security.certs import issue, make_pki

    ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=str(short_tmp("ray")), log_to_driver=False)
    spec = TierSpec(replicas=1, num_cpus=1, max_restarts=2)
    pki = tmp_path_factory.mktemp("pki")
    identity = issue(pki, make_pki(pki, "ray"), "worker")
    tls = TlsConfig(tls_cert=str(identity.cert), tls_key=str(identity.key), tls_ca=str(identity.ca))
    # the prefill is a tensor-parallel worker: one actor asking for both ranks' CPUs, its rank 1 a
    # process of its own (every answer below must still equal the one-process engine's)
    prefill = spec.model_copy(update={"config": WorkerConfig(engine=EngineConfig(tensor_parallel_size=2))})
    deployment = RayDeployment(model="tiny-qwen2-vl", http_port=0, grpc_port=0, colocate_prefill_decode=True,
                               tiers={"encoder": spec, "prefill": prefill, "decode": spec}, tls=tls)
    c = RayEPDCluster(deployment)
    try:
        c.start(timeout_s=300)
        c.wait_healthy(120)
        yield c
    finally:
        c.stop()
        ray.shutdown()


@pytest.fixture(scope="module")
def llm():
    """The in-process engine on the same model (itself held to transformers by the fidelity tests):
    what every answer through the Ray deployment must equal, token for token."""
    from epd.llm import LLM
    return LLM("tiny-qwen2-vl")


def ask(cluster, llm, seed: int) -> str:
    """One greedy image chat through the deployment's HTTP API; its token ids must equal the
    in-process engine's for the same chat."""
    from epd.types import SamplingParams
    from tests.fidelity.reference import user_message

    image_bytes = make_image_bytes(64, 48, seed=seed)
    image = base64.b64encode(image_bytes).decode()
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", max_retries=0, timeout=120)
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
               {"type": "text", "text": "What is it?"}]
    out = client.chat.completions.create(model="tiny-qwen2-vl", max_tokens=6, temperature=0,
                                         messages=[{"role": "user", "content": content}],
                                         extra_body={"return_token_ids": True})
    expected = llm.chat(user_message("What is it?", [image_bytes]), SamplingParams(max_tokens=6))[0]
    assert out.choices[0].model_extra.get("token_ids") == expected.token_ids, seed
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.choices[0].finish_reason in ("length", "stop")
    return out.choices[0].message.content


def test_multimodal_request_through_http(cluster, llm):
    ask(cluster, llm, 1)


def test_the_tensor_parallel_prefill_is_one_actor_with_its_ranks_as_its_processes(cluster):
    """One worker to the router (one address), two ranks: rank 0 the actor, rank 1 its child, and
    Ray counted both ranks' CPUs against the actor."""
    from epd.server.parent import descendants

    assert len(cluster.addresses["prefill"]) == 1
    actor = cluster.actors["prefill"][0]
    pid = ray.get(actor.pid.remote(), timeout=30)
    names = [open(f"/proc/{child}/cmdline", "rb").read() for child in descendants(pid)]
    assert any(b"multiprocessing" in name for name in names), names  # the spawned rank
    assert ray.get(actor.resources.remote(), timeout=30)["CPU"] == 2.0


def test_every_worker_talks_mutual_tls_only(cluster):
    import grpc

    from epd.v1 import common_pb2, decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2_grpc
    stubs = {"encoder": encoder_pb2_grpc.EncoderStub, "prefill": prefill_pb2_grpc.PrefillStub,
             "decode": decode_pb2_grpc.DecodeStub}
    for tier, addresses in cluster.addresses.items():
        for address in addresses:
            with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError) as refused:
                stubs[tier](plain).Health(common_pb2.HealthRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (tier, address)


def test_killed_encoder_actor_is_restarted_and_registered_again(cluster, llm):
    encoder = cluster.actors["encoder"][0]
    old_pid, old_address = ray.get(encoder.pid.remote(), timeout=30), cluster.addresses["encoder"][0]
    ray.kill(encoder, no_restart=False)
    # Ray restarts the actor in a new process, on a port of its own; a call answers once it serves
    deadline = time.monotonic() + 180
    while ray.get(encoder.pid.remote(), timeout=180) == old_pid and time.monotonic() < deadline:
        time.sleep(0.5)
    new_address = ray.get(encoder.address.remote(), timeout=180)
    assert new_address != old_address
    # the registrar told the router: the new address is in rotation, the old one is gone
    health = cluster.wait_healthy(180)
    assert [w["address"] for w in health["workers"]["encoder"]] == [new_address] == cluster.addresses["encoder"]
    ask(cluster, llm, 2)


def test_a_decode_actor_killed_mid_stream_costs_no_request_and_ray_restarts_it(cluster):
    from epd.bench.chaos import LoopingClients, chats, mismatches, moves, references

    cluster.scale("decode", 2)
    cluster.wait_healthy(180)
    # answers long enough that the streams seen on the victim are still on it when Ray kills it (with
    # 32 tokens they could end in between on a loaded machine: no move to assert)
    chat_list = chats(max_tokens=96)
    refs = references(cluster.http_url, "tiny-qwen2-vl", chat_list)
    victim = cluster.actors["decode"][0]
    old_pid = ray.get(victim.pid.remote(), timeout=30)
    with LoopingClients(cluster.http_url, "tiny-qwen2-vl", chat_list, num_clients=4) as clients:
        deadline = time.monotonic() + 120
        while (clients.num_ok < 4 or not _in_flight(cluster, "decode", 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(victim, no_restart=False)  # with streams on it
        done = clients.num_ok
        while clients.num_ok < done + 8 and time.monotonic() < deadline + 120:
            time.sleep(0.1)
    assert not clients.failures(), [f"{o.status} {o.error}" for o in clients.failures()][:5]
    assert not mismatches(clients.snapshot(), refs)
    assert clients.num_ok >= done + 8
    assert sum(moves(cluster.http_url).values()) >= 1
    assert ray.get(victim.pid.remote(), timeout=180) != old_pid  # restarted by Ray, and registered again
    health = cluster.wait_healthy(180)
    assert sorted(w["address"] for w in health["workers"]["decode"]) == sorted(cluster.addresses["decode"])
    cluster.scale("decode", 1)


def _in_flight(cluster, tier: str, index: int) -> int:
    address = cluster.addresses[tier][index]
    return next(w["in_flight"] for w in cluster.health()["workers"][tier] if w["address"] == address)


def test_scale_decode_up_and_down(cluster, llm):
    cluster.scale("decode", 2)
    health = cluster.wait_healthy(180)
    assert len(health["workers"]["decode"]) == 2
    for seed in range(3, 6):
        ask(cluster, llm, seed)
    # scale down while requests keep coming: the removed worker drains, nothing is dropped
    errors: list[Exception] = []

    def traffic():
        for seed in range(10, 16):
            try:
                ask(cluster, llm, seed)
            except Exception as err:  # noqa: BLE001 - asserted below
                errors.append(err)

    worker = threading.Thread(target=traffic)
    worker.start()
    cluster.scale("decode", 1)
    worker.join(300)
    assert not errors, errors
    assert len(cluster.health()["workers"]["decode"]) == 1
    ask(cluster, llm, 7)


def test_prefill_and_decode_were_packed_on_one_node(cluster):
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(cluster._group)
    assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
