"""Request body limits on the HTTP API (and the same on the public gRPC API): each refused with a 413 / 400 that names the limit, before
the core sees the request, and the server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest

from epd.router.body_limits import BodyLimits
from epd.router.openai.app import build_app
from tests.router.fake_core import FakeRouterCore, serve_app

LIMITS = BodyLimits(max_body_bytes=4096, max_messages=3, max_content_parts=4, max_text_chars=500)


@pytest.fixture(scope="module")
def served():
    core = FakeRouterCore()
    with serve_app(build_app(core, limits=LIMITS)) as url:
        yield core, url


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "fake-qwen2-vl", **body}, timeout=10)


def _user(content) -> dict:
    return {"role": "user", "content": content}


@pytest.mark.parametrize("body,status,names", [
    ({"messages": [_user("x" * 5000)]}, 413, "max_request_body_bytes"),
    ({"messages": [_user("hi")] * 4}, 400, "max_messages"),
    ({"messages": [_user([{"type": "text", "text": "a"}] * 5)]}, 400, "max_content_parts"),
    ({"messages": [_user("y" * 300), _user([{"type": "text", "text": "z" * 201}])]}, 400, "max_text_chars"),
], ids=["body", "messages", "parts", "text"])
def test_a_body_over_a_limit_is_refused_naming_it_before_any_work(served, body, status, names):
    core, url = served
    before = len(core.requests)
    response = _post(url, body)
    assert response.status_code == status, response.text
    assert names in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert len(core.requests) == before
    assert _post(url, {"messages": [_user("still here?")]}).status_code == 200


def test_an_oversize_body_without_a_length_is_cut_off_as_it_streams(served):
    _, url = served

    def chunks():
        yield b'{"model": "fake-qwen2-vl", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1024  # 100 KiB in all: far past the 4 KiB limit, sent chunked
        yield b'"}]}'

    response = httpx.post(f"{url}/v1/chat/completions", content=chunks(), timeout=10,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "max_request_body_bytes" in response.text
    json.loads(response.text)  # an OpenAI-shaped JSON body


def _grpc_request(messages):
    from epd.v1 import router_pb2
    return router_pb2.ChatGenerateRequest(messages=[
        router_pb2.ChatMessage(role="user", content=[router_pb2.ContentPart(text=t) for t in texts])
        for texts in messages])


@pytest.mark.parametrize("messages,status,names", [
    ([["x" * 5000]], "RESOURCE_EXHAUSTED", "larger than max"),
    ([["hi"]] * 4, "INVALID_ARGUMENT", "max_messages"),
    ([["a"] * 5], "INVALID_ARGUMENT", "max_content_parts"),
    ([["y" * 300], ["z" * 201]], "INVALID_ARGUMENT", "max_text_chars"),
], ids=["message size", "messages", "parts", "text"])
def test_the_public_grpc_api_has_the_same_limits(messages, status, names):
    import grpc

    from epd.v1 import router_pb2_grpc
    from tests.client.fakes import FakeCore, RouterServerThread

    core = FakeCore()
    with RouterServerThread(core, limits=LIMITS) as server, grpc.insecure_channel(server.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(_grpc_request(messages), timeout=10))
        assert refused.value.code().name == status and names in refused.value.details()
        assert core.requests == []
        assert list(stub.Generate(_grpc_request([["still here?"]]), timeout=10))  # and it serves on
