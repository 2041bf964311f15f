"""Mutual TLS between EPD's processes, with certificates made here. ``epd serve --tls-*`` serves
chats end to end (router -> tiers, encoder -> prefill pushes, consumers -> producers' TensorStore
all over TLS), and every tier refuses a plain-text client, a client without a certificate, one
whose certificate signs itself and one from another CA; a client with the cluster's CA gets in
(the control that shows the refusals are about the certificate)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from epd.client import EPDClient, Unauthenticated
from epd.config import ConfigError, TlsConfig, WorkerConfig, load_config
from epd.models.presets import write_preset_checkpoint
from epd.transport import TensorStore, serve_tensor_store
from epd.v1 import common_pb2, decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2_grpc, tensor_pb2, tensor_pb2_grpc
from epd.wire.rpc import open_channel
from epd.wire.tls import MutualTls
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.e2e.test_openai_serve import chat, data_url
from tests.security.certs import SERVER_NAME, issue, make_pki, self_signed

_STUBS = {"encoder": encoder_pb2_grpc.EncoderStub, "prefill": prefill_pb2_grpc.PrefillStub,
          "decode": decode_pb2_grpc.DecodeStub}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    cluster_ca, stranger_ca = make_pki(directory, "cluster"), make_pki(directory, "stranger")
    return {"dir": directory, "cluster": issue(directory, cluster_ca, "worker"),
            "client": issue(directory, cluster_ca, "client"),
            "dns_only": issue(directory, cluster_ca, "dns-only", ip=False),
            "stranger": issue(directory, stranger_ca, "stranger"),
            "self_signed": self_signed(directory, "self-signed", trusts=cluster_ca[0])}


def _tls(identity, server_name: str | None = None) -> MutualTls:
    return MutualTls.from_config(TlsConfig(tls_cert=str(identity.cert), tls_key=str(identity.key),
                                           tls_ca=str(identity.ca), tls_server_name=server_name))


def _health(address: str, tier: str, channel: grpc.Channel) -> common_pb2.HealthResponse:
    with channel:
        return _STUBS[tier](channel).Health(common_pb2.HealthRequest(), timeout=10)


def _refusals(address: str, pki) -> dict[str, grpc.Channel]:
    """Clients the tiers must refuse; each trusts the cluster's CA, so the refusal is the server's."""
    ca = pki["cluster"].ca.read_bytes()
    stranger = MutualTls(pki["stranger"].cert.read_bytes(), pki["stranger"].key.read_bytes(), ca)
    return {"plain text": grpc.insecure_channel(address),
            "no client certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)),
            "self-signed": open_channel(address, _tls(pki["self_signed"])),
            "another CA": open_channel(address, stranger)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("mtls") / "ckpt", seed=1357)


FILE_KEY, ENV_KEY, ROTATED_KEY = "sk-file-0123456789abcdef", "sk-env-0123456789abcdef", "sk-rotated-0123456789"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


@pytest.fixture(scope="module")
def secured(model_dir, pki, tmp_path_factory):
    """One ``epd serve`` as a careful operator runs it: mutual TLS inside, API keys from a file and
    from the environment (never argv), the admin API on its own loopback listener with a token file."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    (secrets_dir / "keys").write_text(f"# rotated by writing this file\n{FILE_KEY}\n")
    (secrets_dir / "admin").write_text(ADMIN_TOKEN + "\n")
    serve = ServeProcess("--model", str(model_dir), "--served-model-name", "m",
                         *pki["cluster"].flags(),
                         "--api-key-file", str(secrets_dir / "keys"), "--admin-port", "0",
                         "--admin-token-file", str(secrets_dir / "admin"), env={"EPD_API_KEY": ENV_KEY})
    try:
        yield serve, secrets_dir
    finally:
        serve.stop_and_check_clean(model_dir)


def _client(serve, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.base_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.slow
def test_serve_with_mutual_tls_serves_and_every_tier_refuses_strangers(secured, pki):
    serve, _ = secured
    client = _client(serve, FILE_KEY)
    image = make_image_bytes(96, 64, seed=4)
    out = client.chat.completions.create(model="m", max_tokens=3,
                                         messages=chat("What is it?", [data_url(image), data_url(image)]))
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    workers = {m.group(1): m.group(2) for line in serve.lines
               if (m := re.match(r"\s+(encoder|prefill|decode)\s+(\S+) \(pid", line))}
    assert sorted(workers) == ["decode", "encoder", "prefill"], serve.lines
    for tier, address in workers.items():
        for what, channel in _refusals(address, pki).items():
            with pytest.raises(grpc.RpcError) as refused:
                _health(address, tier, channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (tier, what)
        assert _health(address, tier, open_channel(address, _tls(pki["client"]))).tier == tier
    _decode_token_stream_refuses_strangers(workers["decode"], pki)
    # the refused handshakes cost nothing: the cluster still serves
    again = client.chat.completions.create(model="m", max_tokens=2, messages=chat("Again?", [data_url(image)]))
    assert again.choices[0].finish_reason == "length"


def _decode_token_stream_refuses_strangers(address: str, pki) -> None:
    """The decode worker's TCP link (routers' token streams) demands the cluster's certificates as
    its gRPC port does: a stranger gets no byte of a stream; the cluster's client gets one."""
    import asyncio
    import ssl

    from epd.router.backends.tcp_stream import TcpStreamCall
    from epd.v1 import decode_pb2

    health = _health(address, "decode", open_channel(address, _tls(pki["client"])))
    host, port = address.rpartition(":")[0], health.stream_port
    assert port, "the decode worker offers no TCP link"
    ca = pki["cluster"].ca.read_bytes()
    no_cert = ssl.create_default_context(cadata=ca.decode())
    no_cert.check_hostname = False
    strangers = {"plain text": None, "no client certificate": no_cert,
                 "another CA": MutualTls(pki["stranger"].cert.read_bytes(), pki["stranger"].key.read_bytes(),
                                         ca).ssl_client_context()}

    async def stranger_reads(context) -> bytes:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host, port, ssl=context, server_hostname=host if context else None), 10)
            writer.write(b"\x00" * 16)  # no TLS record, or a frame nobody may send
            return await asyncio.wait_for(reader.read(), 10)
        except (ssl.SSLError, ConnectionError):
            return b""

    async def member_opens() -> bool:
        call = TcpStreamCall(host, port, health.stream_token, _tls(pki["client"]))
        await call.write(decode_pb2.StreamCommand(cancel="nothing-running"))  # a no-op once in
        await call.done_writing()
        return [batch async for batch in call] == []

    for what, context in strangers.items():
        assert asyncio.run(stranger_reads(context)) == b"", what
    assert asyncio.run(member_opens())


@pytest.mark.slow
def test_serve_takes_keys_from_a_file_and_the_environment_on_both_apis_and_rotates_them(secured):
    serve, secrets_dir = secured
    for key in ("unused", ROTATED_KEY):
        with pytest.raises(openai.AuthenticationError):
            _client(serve, key).chat.completions.create(model="m", max_tokens=1, messages=chat("Hi", []))
        with EPDClient(serve.grpc_address, timeout_s=60, api_key=key) as sdk, pytest.raises(Unauthenticated):
            sdk.chat("Hi", max_tokens=1)
    for key in (FILE_KEY, ENV_KEY):
        assert _client(serve, key).chat.completions.create(model="m", max_tokens=1, messages=chat("Hi", [])).choices
        with EPDClient(serve.grpc_address, timeout_s=60, api_key=key) as sdk:
            assert sdk.chat("Hi", max_tokens=1).finish_reason == "length"
    assert httpx.get(f"{serve.base_url}/health", timeout=10).status_code == 200  # open by default
    (secrets_dir / "keys").write_text(ROTATED_KEY + "\n")  # rotation: no restart
    assert wait_until(lambda: _status(serve, ROTATED_KEY) == 200 and _status(serve, FILE_KEY) == 401, 10)
    assert _status(serve, ENV_KEY) == 200


def _status(serve, key: str) -> int:
    return httpx.get(f"{serve.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


@pytest.mark.slow
def test_serve_puts_the_admin_api_on_its_own_loopback_listener_behind_its_token(secured):
    serve, _ = secured
    (admin_url,) = [m.group(1) for line in serve.lines if (m := re.match(r"\s+admin API\s+(\S+)/admin/workers", line))]
    assert admin_url.startswith("http://127.0.0.1:") and admin_url != serve.base_url
    body = {"tier": "encoder", "address": "127.0.0.1:1"}
    public = httpx.post(f"{serve.base_url}/admin/workers", json=body, timeout=10,
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert public.status_code == 404
    for headers in ({}, {"Authorization": f"Bearer {FILE_KEY}"}):  # an API key is no admin token
        assert httpx.post(f"{admin_url}/admin/workers", json=body, headers=headers, timeout=10).status_code == 401
    refused = httpx.post(f"{admin_url}/admin/workers", json=body, timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert refused.status_code == 400, refused.text  # nothing answers EPD's health there


@pytest.mark.slow
def test_no_secret_reaches_argv_or_the_output(secured):
    serve, _ = secured
    secrets = (FILE_KEY, ENV_KEY, ROTATED_KEY, ADMIN_TOKEN)
    pids = _tree(serve.proc.pid)
    assert len(pids) >= 5, pids  # epd serve, router, three workers (and the zygote they were forked from)
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert not any(secret in argv for secret in secrets), argv
    output = "\n".join(serve.lines)
    assert not any(secret in output for secret in secrets)
    metrics = httpx.get(f"{serve.base_url}/metrics", timeout=10).text
    assert not any(secret in metrics for secret in secrets)


def _tree(root: int) -> list[int]:
    """``root`` and every process below it, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:  # gone meanwhile
            continue
        if stat:
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        found.append(pid := todo.pop())
        todo.extend(children.get(pid, []))
    return found


def test_a_certificate_for_a_name_is_checked_against_tls_server_name(pki):
    """One certificate for every pod: it names the service, not each pod's IP. Without
    tls_server_name the address (127.0.0.1) does not match it and the channel is refused."""
    store = TensorStore()
    server = serve_tensor_store(store, tls=_tls(pki["dns_only"]))
    try:
        request = tensor_pb2.ReleaseRequest(lease_ids=["nothing"])
        with open_channel(store.address, _tls(pki["client"], server_name=SERVER_NAME)) as named:
            assert tensor_pb2_grpc.TensorStoreStub(named).Release(request, timeout=10).num_released == 0
        with open_channel(store.address, _tls(pki["client"])) as by_address:
            with pytest.raises(grpc.RpcError) as refused:
                tensor_pb2_grpc.TensorStoreStub(by_address).Release(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
        store.close()


@pytest.mark.parametrize("tls, expected", [
    ({"tls_cert": "CERT"}, "mutual TLS needs tls_cert, tls_key and tls_ca together; missing ['tls_ca', 'tls_key']"),
    ({"tls_cert": "/nonexistent.pem", "tls_key": "KEY", "tls_ca": "CA"}, "tls.tls_cert: expected a readable PEM file"),
    ({"tls_server_name": "x"}, "tls_server_name applies only with tls_cert, tls_key and tls_ca"),
])
def test_an_incomplete_tls_block_is_one_line_naming_it(pki, tls, expected):
    files = {"CERT": str(pki["cluster"].cert), "KEY": str(pki["cluster"].key), "CA": str(pki["cluster"].ca)}
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(WorkerConfig, {"tls": {k: files.get(v, v) for k, v in tls.items()}})


def test_a_file_that_is_not_pem_is_refused_at_start(tmp_path, pki):
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a")
    config = TlsConfig(tls_cert=str(not_pem), tls_key=str(pki["cluster"].key), tls_ca=str(pki["cluster"].ca))
    with pytest.raises(ValueError, match=r"tls_cert: expected a PEM file, .*cert.der has no '-----BEGIN' line"):
        MutualTls.from_config(config)


def test_serve_takes_one_tls_block_from_either_yaml_and_refuses_two_that_differ(pki):
    from epd.config import ServeConfig
    block = {"tls_cert": str(pki["cluster"].cert), "tls_key": str(pki["cluster"].key), "tls_ca": str(pki["cluster"].ca)}
    for where in ("router", "worker"):
        config = load_config(ServeConfig, {where: {"tls": block}})
        assert config.router.tls == config.worker.tls == TlsConfig(**block)
    other = {**block, "tls_cert": str(pki["client"].cert), "tls_key": str(pki["client"].key)}
    with pytest.raises(ConfigError, match="router.tls differs from worker.tls; give mutual TLS once"):
        load_config(ServeConfig, {"router": {"tls": block}, "worker": {"tls": other}})
    assert not load_config(ServeConfig, {}).router.tls.enabled
