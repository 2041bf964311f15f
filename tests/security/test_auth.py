"""API keys on the public APIs and a token on the admin API. HTTP (the official openai client
included) and gRPC (the SDK) refuse a missing or wrong key with 401 / UNAUTHENTICATED in their own
error shapes, take the right one, leave /health and /metrics open unless asked, rotate keys from a
file without a restart, and never put a key in a log line or an error. The admin API lives on its
own listener with its own token and registers only live EPD workers of the right tier and model."""
from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import httpx
import openai
import pytest

from epd.client import EPDClient
from epd.errors import Unauthenticated
from epd.router import auth
from epd.router.auth import ApiKeys
from epd.router.grpc_api import ApiKeyInterceptor
from epd.router.openai.app import build_app
from epd.router.workers import WorkerRegistry
from epd.server.router import build_admin_app
from epd.v1 import common_pb2, encoder_pb2_grpc
from tests.client.fakes import FakeCore as GrpcCore
from tests.client.fakes import RouterServerThread
from tests.router.fake_core import FakeRouterCore, serve_app

KEY, OTHER = "sk-epd-test-0123456789abcdef", "sk-epd-test-wrong-key-000000"


@pytest.fixture
def http_url():
    app = build_app(FakeRouterCore(), api_keys=ApiKeys([KEY], environ={}))
    with serve_app(app) as url:
        yield url


def _chat(url: str, headers: dict) -> httpx.Response:
    body = {"model": "fake-qwen2-vl", "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=10)


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {OTHER}"}, {"Authorization": KEY},
                                     {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"}],
                         ids=["none", "wrong", "no-scheme", "empty", "basic"])
def test_http_without_the_right_key_is_a_401_in_openais_shape(http_url, headers):
    for response in (_chat(http_url, headers), httpx.get(f"{http_url}/v1/models", headers=headers, timeout=10)):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == 401
        assert KEY not in response.text and OTHER not in response.text


def test_http_with_the_key_serves_and_health_and_metrics_stay_open(http_url):
    assert _chat(http_url, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{http_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{http_url}/metrics", timeout=10).status_code == 200


def test_the_official_openai_client_just_works_with_its_api_key(http_url):
    good = openai.OpenAI(base_url=f"{http_url}/v1", api_key=KEY, max_retries=0, timeout=10)
    assert good.chat.completions.create(model="fake-qwen2-vl", messages=[{"role": "user", "content": "hi"}]
                                        ).choices[0].message.content == "Hello, world!"
    bad = openai.OpenAI(base_url=f"{http_url}/v1", api_key=OTHER, max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_and_metrics_can_be_protected_too():
    app = build_app(FakeRouterCore(), api_keys=ApiKeys([KEY], environ={}), protect_health_and_metrics=True)
    with serve_app(app) as url:
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 401
            assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200


def test_no_key_configured_leaves_the_api_open():
    with serve_app(build_app(FakeRouterCore(), api_keys=ApiKeys(environ={}))) as url:
        assert _chat(url, {}).status_code == 200


def test_keys_come_from_the_environment_and_rotate_through_the_key_file(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "_RECHECK_S", 0.0)
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team A\n{KEY}\n\n")
    keys = ApiKeys(key_file=key_file, environ={"EPD_API_KEY": "env-key-1, env-key-2"})
    assert keys.allows(KEY) and keys.allows("env-key-2") and not keys.allows(OTHER)
    key_file.write_text(f"{OTHER}  # the new key\n")  # rotated: the old one stops working at once
    assert keys.allows(OTHER) and not keys.allows(KEY) and keys.allows("env-key-1")
    key_file.unlink()  # gone: its keys admit nobody (fail closed)
    assert not keys.allows(OTHER)


def test_a_refused_key_is_never_logged_or_echoed(caplog):
    keys = ApiKeys([KEY], environ={})
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(Unauthenticated) as raised:
            keys.check_bearer(f"Bearer {OTHER}")
    assert OTHER not in str(raised.value) and KEY not in str(raised.value)
    assert OTHER not in caplog.text and KEY not in caplog.text


def test_grpc_needs_the_key_in_metadata_and_the_sdk_sends_it():
    with RouterServerThread(GrpcCore(), interceptors=[ApiKeyInterceptor(ApiKeys([KEY], environ={}))]) as server:
        for key in (None, OTHER):
            with EPDClient(server.address, timeout_s=10, api_key=key) as client:
                with pytest.raises(Unauthenticated):
                    client.chat("hi", max_tokens=4)
                with pytest.raises(Unauthenticated):
                    client.models()
        with EPDClient(server.address, timeout_s=10, api_key=KEY) as client:
            assert client.chat("hi", max_tokens=4).text
            assert client.models()
        with EPDClient(server.address, timeout_s=10) as client:
            assert client.health().status  # open unless protect_health_and_metrics


def test_grpc_health_needs_the_key_when_protected():
    interceptor = ApiKeyInterceptor(ApiKeys([KEY], environ={}), protect_health=True)
    with RouterServerThread(GrpcCore(), interceptors=[interceptor]) as server:
        with EPDClient(server.address, timeout_s=10) as client, pytest.raises(Unauthenticated):
            client.health()
        with EPDClient(server.address, timeout_s=10, api_key=KEY) as client:
            assert client.health().status


def test_the_admin_listener_is_off_unless_asked_and_needs_a_token_to_start(monkeypatch):
    from types import SimpleNamespace

    from epd.config import RouterConfig
    from epd.server.router import _start_admin
    router = SimpleNamespace(backend=SimpleNamespace(workers=WorkerRegistry({"encoder": []})))
    monkeypatch.delenv("EPD_ADMIN_TOKEN", raising=False)
    off = RouterConfig(model="m", encoders=["127.0.0.1:1"], prefills=["127.0.0.1:2"], decodes=["127.0.0.1:3"])
    assert off.admin_port is None and off.admin_host == "127.0.0.1"
    assert asyncio.run(_start_admin(off, router)) is None
    asked = off.model_copy(update={"admin_port": 0})
    with pytest.raises(RuntimeError, match="admin_port is set but no admin token is"):
        asyncio.run(_start_admin(asked, router))


# ---- the admin API ------------------------------------------------------------------------------------
class _EncoderHealth(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, tier: str, model: str) -> None:
        self.tier, self.model = tier, model

    async def Health(self, request, context):
        return common_pb2.HealthResponse(status="SERVING", tier=self.tier, model=self.model)


def test_admin_api_needs_its_token_and_registers_only_live_epd_workers_of_its_model():
    async def scenario():
        servers, addresses = [], {}
        for name, tier, model in (("good", "encoder", "m"), ("wrong-model", "encoder", "other"),
                                  ("wrong-tier", "decode", "m")):
            server = grpc.aio.server()
            encoder_pb2_grpc.add_EncoderServicer_to_server(_EncoderHealth(tier, model), server)
            addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
        with socket.socket() as not_grpc:  # something listening that is not an EPD worker
            not_grpc.bind(("127.0.0.1", 0))
            not_grpc.listen()
            addresses["stranger"] = f"127.0.0.1:{not_grpc.getsockname()[1]}"
            registry = WorkerRegistry({"encoder": []}, health_timeout_s=2)
            app = build_admin_app(registry, "m", ApiKeys(["admin-token-123"], environ={}))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://admin") as http:
                body = {"tier": "encoder", "address": addresses["good"]}
                assert (await http.post("/admin/workers", json=body)).status_code == 401
                assert (await http.post("/admin/workers", json=body, headers={"Authorization": "Bearer x"})
                        ).status_code == 401
                auth_header = {"Authorization": "Bearer admin-token-123"}
                for name in ("stranger", "wrong-model", "wrong-tier"):
                    refused = await http.post("/admin/workers", json={"tier": "encoder", "address": addresses[name]},
                                              headers=auth_header)
                    assert refused.status_code == 400, (name, refused.text)
                accepted = await http.post("/admin/workers", json=body, headers=auth_header)
                assert accepted.status_code == 200 and accepted.json()["healthy"]
                assert (await http.get("/admin/workers")).status_code == 401  # the list is the admin's too
                listed = (await http.get("/admin/workers", headers=auth_header)).json()["workers"]
                assert [w["address"] for w in listed["encoder"]] == [addresses["good"]]
            assert [w.address for w in registry.workers["encoder"]] == [addresses["good"]]
            await registry.close()
        for server in servers:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_public_port_has_no_admin_api(http_url):
    response = httpx.post(f"{http_url}/admin/workers", json={"tier": "encoder", "address": "127.0.0.1:1"},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert response.status_code == 404


def test_a_key_over_its_rate_gets_429_with_retry_after_and_other_keys_do_not_notice():
    from epd.router.rate_limit import KeyRateLimiter

    now_s = [0.0]
    limiter = KeyRateLimiter(2.0, 3, clock=lambda: now_s[0])
    app = build_app(FakeRouterCore(), api_keys=ApiKeys([KEY, OTHER], environ={}), rate_limiter=limiter)
    with serve_app(app) as url:
        statuses = [_chat(url, {"Authorization": f"Bearer {KEY}"}).status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429]  # the burst, then the bucket is empty
        refused = _chat(url, {"Authorization": f"Bearer {KEY}"})
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == 429
        assert "rate limit of 2 requests/s" in refused.json()["error"]["message"] and KEY not in refused.text
        assert _chat(url, {"Authorization": f"Bearer {OTHER}"}).status_code == 200  # its own bucket
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
        now_s[0] += 0.5  # one token back at 2/s
        assert _chat(url, {"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_grpc_api_rate_limits_generate_per_key():
    from epd.router.rate_limit import KeyRateLimiter

    limiter = KeyRateLimiter(0.001, 1)
    interceptor = ApiKeyInterceptor(ApiKeys([KEY], environ={}), rate_limiter=limiter)
    with RouterServerThread(GrpcCore(), interceptors=[interceptor]) as server:
        with EPDClient(server.address, api_key=KEY, timeout_s=10) as client:
            client.chat([{"role": "user", "content": "hi"}])
            with pytest.raises(Exception) as refused:
                client.chat([{"role": "user", "content": "again"}])
            assert "rate limit" in str(refused.value) and KEY not in str(refused.value)
            assert client.health()  # Health is not rate limited


def test_a_rate_limit_without_keys_is_a_one_line_start_error(capsys):
    from epd.server.router import main

    with pytest.raises(SystemExit) as exited:
        main(["--api-key-requests-per-s", "5", "--port", "0", "--grpc-port", "0"])
    assert exited.value.code == 2
    assert "api_key_requests_per_s limits each API key, but no API key is set" in capsys.readouterr().err


def test_epd_serve_speaks_to_its_routers_admin_api_with_a_token_the_router_takes(tmp_path, monkeypatch):
    """``admin_token``: read as the router reads it (EPD_ADMIN_TOKEN comma-separated, then the
    file's lines), else one made for this launch; none without a planner to carry out."""
    from types import SimpleNamespace

    from epd.router.auth import ENV_ADMIN_TOKEN
    from epd.server.serve import admin_token

    planned = SimpleNamespace(autoscale_budget=4, admin_token_file=None)
    monkeypatch.setenv(ENV_ADMIN_TOKEN, " first-token , second")
    assert admin_token(planned) == "first-token"
    assert ApiKeys((), None, env_var=ENV_ADMIN_TOKEN).check_bearer("Bearer first-token") is not None
    monkeypatch.delenv(ENV_ADMIN_TOKEN)
    tokens = tmp_path / "admin"
    tokens.write_text("# ours\nfrom-file\n")
    assert admin_token(SimpleNamespace(autoscale_budget=4, admin_token_file=str(tokens))) == "from-file"
    made = admin_token(planned)
    assert len(made) >= 32 and made != admin_token(planned)
    assert admin_token(SimpleNamespace(autoscale_budget=None, admin_token_file=None)) is None
