"""EPDClient against the real Router gRPC service over a scripted core."""
from __future__ import annotations

import base64
import gc
import io
import socket
import time

import grpc
import pytest
from PIL import Image

from epd import errors
from epd.client import (
    ChatDelta,
    DeadlineExceeded,
    EPDClient,
    EPDError,
    InvalidRequest,
    Overloaded,
    TokenLogprob,
    Unavailable,
)
from epd.types import MAX_TOKENS_TO_FILL, SamplingParams
from tests.conftest import make_image_bytes

WAIT_S = 5.0


@pytest.fixture
def client(address):
    with EPDClient(address, timeout_s=10) as client:
        yield client


def png_of(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_chat_returns_the_whole_result(client, core):
    result = client.chat("Hi", logprobs=1)
    assert result.text == "Hello world"
    assert result.token_ids == [10, 11, 12, 13]
    assert result.prompt_token_ids == [1, 2, 3]
    assert result.finish_reason == "length"
    assert result.num_cached_tokens == 2
    assert result.logprobs[0] == TokenLogprob(10, -0.5, {10: -0.5, 99: -1.5})
    assert [lp.token_id for lp in result.logprobs] == [10, 11, 12, 13]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens,
            result.usage.total_tokens) == (3, 4, 2, 7)
    assert result.request_id.startswith("grpc-")
    assert core.finished.is_set() and not core.closed.is_set()


def test_stream_yields_typed_deltas_prompt_on_the_first(client):
    deltas = list(client.stream("Hi"))
    assert all(isinstance(d, ChatDelta) for d in deltas)
    assert [d.text for d in deltas] == ["Hel", "lo wor", "ld"]
    assert [d.token_ids for d in deltas] == [[10], [11, 12], [13]]
    assert [d.prompt_token_ids for d in deltas] == [[1, 2, 3], None, None]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert deltas[0].num_cached_tokens == 2


def test_request_fields_reach_the_core(client, core):
    client.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], max_tokens=5,
                temperature=0.7, top_p=0.9, top_k=40, seed=7, logprobs=2, stop=["\n", "END"], timeout_s=3,
                request_id="req-1")
    request = core.requests[0]
    assert request.request_id == "req-1"
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    sampling = request.sampling  # floats travel as float32
    assert (sampling.temperature, sampling.top_p) == (pytest.approx(0.7), pytest.approx(0.9))
    assert sampling == SamplingParams(max_tokens=5, temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=40, seed=7, logprobs=2)
    assert request.stop_strings == ["\n", "END"]
    assert 0 < request.timeout_s <= 3


def test_unset_options_get_the_server_defaults(client, core):
    client.chat("Hi")
    # what HTTP gives a request that names nothing: OpenAI's temperature 1, and max_tokens left for the
    # pipeline to fill in from the model length (vLLM's default)
    assert core.requests[0].sampling == SamplingParams(max_tokens=MAX_TOKENS_TO_FILL, temperature=1.0)
    assert core.requests[0].fill_max_tokens
    assert 0 < core.requests[0].timeout_s <= 10  # the client's default deadline bounds the request


def test_images_from_path_bytes_and_pil_arrive_as_the_same_bytes(client, core, tmp_path):
    path_bytes, raw_bytes = make_image_bytes(20, 16, seed=1), make_image_bytes(8, 8, seed=2, fmt="JPEG")
    (tmp_path / "a.png").write_bytes(path_bytes)
    pil = Image.new("RGB", (12, 10), (200, 30, 40))
    client.chat("Compare", images=[tmp_path / "a.png", raw_bytes, pil, str(tmp_path / "a.png")])
    content = core.requests[0].messages[-1]["content"]
    assert [p["type"] for p in content] == ["image"] * 4 + ["text"]  # images before the text
    assert [p["image"] for p in content[:4]] == [path_bytes, raw_bytes, png_of(pil), path_bytes]
    assert content[4] == {"type": "text", "text": "Compare"}


def test_openai_style_parts(client, core, media_root):
    png, jpeg = make_image_bytes(16, 16, seed=3), make_image_bytes(16, 16, seed=4, fmt="JPEG")
    (media_root / "b.jpg").write_bytes(jpeg)
    pil = Image.new("L", (5, 7), 128)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    client.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": {"url": f"file://{media_root / 'b.jpg'}"}},
        {"type": "image", "image": pil},
        {"type": "text", "text": "What differs?"}]}])
    content = core.requests[0].messages[0]["content"]
    assert [p.get("image") for p in content[:3]] == [png, jpeg, png_of(pil)]
    assert content[3] == {"type": "text", "text": "What differs?"}


def test_file_url_outside_the_allowed_root_is_invalid(client, core, tmp_path):
    (tmp_path / "secret.png").write_bytes(make_image_bytes(4, 4))
    with pytest.raises(InvalidRequest, match="outside the allowed root") as info:
        client.chat([{"role": "user", "content": [{"type": "image_url", "image_url": f"file://{tmp_path}/secret.png"},
                                                  {"type": "text", "text": "?"}]}])
    assert info.value.grpc_status() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].content[0]" in str(info.value)
    assert core.requests == []


@pytest.mark.parametrize("raised, error_type, code", [
    (errors.InvalidRequest, InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.Overloaded, Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.UpstreamError, EPDError, grpc.StatusCode.INTERNAL),  # a tier failed: 502 over HTTP
    (errors.NotFound, errors.NotFound, grpc.StatusCode.NOT_FOUND),
])
def test_router_errors_map_to_typed_errors(client, core, raised, error_type, code):
    core.error = raised(f"scripted failure {raised.__name__}",
                        retry_after_s=2.5 if raised is errors.Overloaded else None)
    with pytest.raises(error_type, match=f"scripted failure {raised.__name__}") as info:
        client.chat("Hi")
    assert info.value.grpc_status() == code
    if raised is errors.Overloaded:
        assert info.value.retry_after_s == 2.5


def test_error_mid_stream_after_deltas(client, core):
    core.error, core.error_after = errors.UpstreamError("decode worker died"), 1
    stream = client.stream("Hi")
    assert next(stream).text == "Hel"
    with pytest.raises(EPDError, match="decode worker died") as info:
        next(stream)
    assert info.value.grpc_status() == grpc.StatusCode.INTERNAL


def test_a_bug_in_the_core_is_internal(client, core):
    core.error = KeyError("oops")
    with pytest.raises(EPDError, match="internal error: KeyError") as info:
        client.chat("Hi")
    assert info.value.grpc_status() == grpc.StatusCode.INTERNAL


def test_invalid_sampling_is_refused_by_the_server(client, core):
    with pytest.raises(InvalidRequest, match="temperature"):
        client.chat("Hi", temperature=-1.0)
    assert core.requests == []


@pytest.mark.parametrize("options", [{"top_p": 0.0}, {"top_k": 0}, {"max_tokens": 0}, {"logprobs": -1}])
def test_zeros_the_wire_cannot_carry_are_refused_locally(client, options):
    with pytest.raises(InvalidRequest):
        client.chat("Hi", **options)


def test_timeout_is_deadline_exceeded_and_cancels_the_core(client, core):
    core.is_hanging = True
    with pytest.raises(DeadlineExceeded):
        client.chat("Hi", timeout_s=0.5)
    assert core.closed.wait(WAIT_S)


def test_closing_a_stream_midway_closes_the_core_iterator(client, core):
    core.is_hanging = True
    with client.stream("Hi") as stream:
        assert next(stream).text == "Hel"
    assert core.closed.wait(WAIT_S)
    assert not core.finished.is_set()


def test_breaking_out_of_a_stream_cancels_it(client, core):
    core.is_hanging = True
    for delta in client.stream("Hi"):
        break
    gc.collect()
    assert core.closed.wait(WAIT_S)


def test_models_and_health(client):
    assert client.models() == ["fake-vl"]
    health = client.health()
    assert health.status == "degraded" and not health.is_ok and health.model == "fake-vl"
    assert [(w.tier, w.address, w.is_healthy) for w in health.workers] == [
        ("encoder", "127.0.0.1:1", True), ("decode", "127.0.0.1:2", False)]
    assert health.workers[0].details == {"num_running": "3"}


def test_no_server_is_unavailable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with EPDClient(f"127.0.0.1:{port}", timeout_s=5) as client:
        with pytest.raises(Unavailable):
            client.chat("Hi")


def test_an_overloaded_router_is_asked_again_after_its_retry_after(address, core):
    from epd.errors import Overloaded as ServerOverloaded
    core.refusals = [ServerOverloaded("saturated", retry_after_s=0.3), ServerOverloaded("saturated", retry_after_s=0.3)]
    start = time.monotonic()
    with EPDClient(address, timeout_s=10) as client:
        assert client.chat("Hi").text == "Hello world"
    assert time.monotonic() - start >= 0.6 and len(core.requests) == 1  # two refusals waited out, one served
    core.refusals = [ServerOverloaded("saturated", retry_after_s=0.1)] * 3
    with EPDClient(address, timeout_s=10, max_retries=2) as client, pytest.raises(Overloaded, match="saturated"):
        client.chat("Hi")  # out of retries: the third refusal reaches the caller
    core.refusals = [ServerOverloaded("saturated", retry_after_s=30)]
    with EPDClient(address, timeout_s=5) as client, pytest.raises(Overloaded):
        client.chat("Hi")  # a hint past the deadline is not waited for


def test_the_async_client_retries_an_overloaded_router_too(address, core):
    import asyncio

    from epd.client import AsyncEPDClient
    from epd.errors import Overloaded as ServerOverloaded
    core.refusals = [ServerOverloaded("saturated", retry_after_s=0.2)]

    async def run() -> str:
        async with AsyncEPDClient(address, timeout_s=10) as client:
            return (await client.chat("Hi")).text
    assert asyncio.run(run()) == "Hello world"
