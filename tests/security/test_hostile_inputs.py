"""The hostile-input corpus (``tests/security/hostile.py``) against a real ``epd serve``: every case
gets its 4xx with an OpenAI-shaped error naming what was wrong, within a few seconds, and
afterwards the server still serves, no worker restarted and none logged a traceback. Two more
cases talk to the workers' own gRPC ports as a stranger would (no mutual TLS in this cluster): an
encode call naming a non-EPD push destination, and pushes for a request prefill does not hold."""
from __future__ import annotations

import re
import time

import grpc
import httpx
import pytest

from epd.models.presets import write_preset_checkpoint
from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc, tensor_pb2
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess
from tests.router.fake_core import send_bytes, serve_files
from tests.security.hostile import LIMITS, MODEL, TEXT, Case, cases, chat, data_url, image

pytestmark = pytest.mark.slow
ANSWER_WITHIN_S = 10.0  # generous for a loaded 2-core CI host; most answer in milliseconds
_NAMES = [c.name for c in cases("/media", "http://127.0.0.1:1")]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    (directory / "ok.png").write_bytes(make_image_bytes(32, 32, seed=1))
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_dir):
    model_dir = write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("hostile") / "ckpt", seed=97)
    flags = [arg for key, value in LIMITS.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    serve = ServeProcess("--model", str(model_dir), "--served-model-name", MODEL,
                         "--allowed-local-media-path", str(media_dir), *flags)
    yield serve
    serve.stop_and_check_clean(model_dir)


@pytest.fixture(scope="module")
def corpus(media_dir) -> dict[str, Case]:
    image_bytes = make_image_bytes(32, 32, seed=2)
    with serve_files({"/a.png": send_bytes(image_bytes)}) as loopback_url:
        yield {c.name: c for c in cases(str(media_dir), loopback_url)}


def _send(url: str, case: Case) -> httpx.Response:
    headers = {"Content-Type": case.content_type, **case.headers}
    if isinstance(case.body, dict):
        return httpx.post(f"{url}/v1/chat/completions", json=case.body, headers=headers, timeout=60)
    return httpx.post(f"{url}/v1/chat/completions", content=case.body, headers=headers, timeout=60)


def test_the_corpus_has_at_least_thirty_cases():
    assert len(_NAMES) >= 30 and len(set(_NAMES)) == len(_NAMES)


@pytest.mark.parametrize("name", _NAMES)
def test_a_hostile_input_is_a_clear_4xx(server, corpus, name):
    case = corpus[name]
    start_s = time.monotonic()
    response = _send(server.base_url, case)
    took_s = time.monotonic() - start_s
    assert response.status_code == case.status, response.text[:500]
    error = response.json()["error"]  # OpenAI's shape: {"error": {"message", "type", "param", "code"}}
    assert set(error) >= {"message", "type", "code"} and error["code"] == case.status
    assert re.search(case.message, error["message"]), error["message"]
    assert "Traceback" not in response.text and len(error["message"]) < 2000
    assert took_s < ANSWER_WITHIN_S, f"{name} took {took_s:.1f} s"


def _worker_addresses(server) -> dict[str, str]:
    return {m.group(1): m.group(2) for line in server.lines
            if (m := re.match(r"\s+(encoder|prefill|decode)\s+(\S+) \(pid", line))}


def test_a_stranger_cannot_make_an_encoder_push_to_an_address_of_its_choice(server, corpus):
    """The destination answers EPD's health RPC, but as a decode worker: nothing is pushed to it,
    and nothing is encoded either (the check comes first, so a stranger's call costs no forward)."""
    addresses = _worker_addresses(server)
    request = encoder_pb2.EncodeRequest(request_id="stranger-1", prefill_address=addresses["decode"],
                                        items=[common_pb2.MultimodalItem(
                                            data=make_image_bytes(32, 32, seed=8), content_hash="c" * 64,
                                            item_index=0, expected_rows=4, encoder_tokens=16)])
    with grpc.insecure_channel(addresses["encoder"]) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)
        encoded_before = stub.Health(common_pb2.HealthRequest(), timeout=10).num_encoded_items
        with pytest.raises(grpc.RpcError) as refused:
            stub.Encode(request, timeout=30)
        assert stub.Health(common_pb2.HealthRequest(), timeout=10).num_encoded_items == encoded_before
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert re.search(r"prefill_address .* is not a prefill worker of model .*\(it answered without EPD's prefill "
                     r"service\): nothing pushed", refused.value.details())


def _encode_as_a_stranger(server, request_id: str, data: bytes, claimed_hash: str) -> list[bool]:
    """An Encode call naming the real prefill worker (which holds no such request, so it refuses
    the pushes and hands their leases back) -> the call's cache hits."""
    addresses = _worker_addresses(server)
    request = encoder_pb2.EncodeRequest(request_id=request_id, prefill_address=addresses["prefill"],
                                        items=[common_pb2.MultimodalItem(
                                            data=data, content_hash=claimed_hash, modality="image",
                                            item_index=0, expected_rows=4, encoder_tokens=16)])
    with grpc.insecure_channel(addresses["encoder"]) as channel:
        return list(encoder_pb2_grpc.EncoderStub(channel).Encode(request, timeout=60).cache_hits)


def test_a_stranger_cannot_store_one_images_embeddings_under_anothers_hash(server, corpus):
    """The encoder keys its cache by a hash of the bytes it was sent: image X sent under image Y's
    content hash is cached as X, so Y's next user gets Y's embeddings (a miss, not X's rows)."""
    x, y, claimed = make_image_bytes(32, 32, seed=21), make_image_bytes(32, 32, seed=22), "d" * 64
    assert _encode_as_a_stranger(server, "poison-1", x, claimed) == [False]
    assert _encode_as_a_stranger(server, "poison-2", y, claimed) == [False]  # was a hit on X's rows
    assert _encode_as_a_stranger(server, "poison-3", y, "e" * 64) == [True]  # the label is not the key


def test_pushes_for_a_request_prefill_does_not_hold_are_refused_unread(server, corpus):
    """A handle naming a producer that does not exist: were it imported, the call would wait on
    that producer; refused, it answers at once and hands the lease back."""
    handle = tensor_pb2.TensorHandle(lease_id="stranger-lease", producer_address="127.0.0.1:1")
    push = common_pb2.EmbeddingPush(request_id="never-registered", item_index=0, embedding=handle)
    with grpc.insecure_channel(_worker_addresses(server)["prefill"]) as channel:
        start_s = time.monotonic()
        reply = prefill_pb2_grpc.PrefillStub(channel).PushEmbeddings(
            prefill_pb2.PushEmbeddingsRequest(pushes=[push] * 3), timeout=30)
    assert reply.num_accepted == 0 and list(reply.refused_lease_ids) == ["stranger-lease"] * 3
    assert time.monotonic() - start_s < ANSWER_WITHIN_S


def test_after_the_corpus_the_server_serves_and_no_worker_restarted(server, corpus):
    for name in _NAMES:  # the whole corpus once more, back to back
        assert _send(server.base_url, corpus[name]).status_code < 500, name
    body = chat(image(data_url(make_image_bytes(48, 32, seed=6))), TEXT)
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    health = httpx.get(f"{server.base_url}/health", timeout=10).json()
    assert health["status"] == "ok", health
    log = "\n".join(server.lines)
    assert "restart" not in log and "Traceback" not in log, log[-3000:]
