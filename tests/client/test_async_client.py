"""AsyncEPDClient against the real Router gRPC service; each test runs its own event loop."""
from __future__ import annotations

import asyncio
import io

import grpc
import pytest
from PIL import Image

from epd import errors
from epd.client import AsyncEPDClient, DeadlineExceeded, EPDError, InvalidRequest, Overloaded, Unavailable
from tests.conftest import make_image_bytes

WAIT_S = 5.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_chat_and_usage(address, core):
    async def main():
        async with AsyncEPDClient(address, timeout_s=10) as client:
            return await client.chat("Hi", max_tokens=4, logprobs=True)

    result = run(main())
    assert (result.text, result.token_ids, result.prompt_token_ids) == ("Hello world", [10, 11, 12, 13], [1, 2, 3])
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.num_cached_tokens) == (3, 4, 2)
    assert core.requests[0].sampling.max_tokens == 4 and core.requests[0].sampling.logprobs == 0


def test_stream_deltas(address):
    async def main():
        async with AsyncEPDClient(address) as client:
            return [delta async for delta in client.stream("Hi")]

    deltas = run(main())
    assert [d.text for d in deltas] == ["Hel", "lo wor", "ld"]
    assert [d.prompt_token_ids for d in deltas] == [[1, 2, 3], None, None]
    assert deltas[-1].finish_reason == "length"


def test_images_arrive_as_the_same_bytes(address, core, tmp_path):
    path_bytes, raw_bytes = make_image_bytes(9, 9, seed=5), make_image_bytes(6, 6, seed=6)
    (tmp_path / "c.png").write_bytes(path_bytes)
    pil = Image.new("RGBA", (4, 3), (1, 2, 3, 4))
    expected_pil = io.BytesIO()
    pil.save(expected_pil, format="PNG")

    async def main():
        async with AsyncEPDClient(address) as client:
            await client.chat([{"role": "user", "content": "Look"}], images=[tmp_path / "c.png", raw_bytes, pil])

    run(main())
    content = core.requests[0].messages[0]["content"]
    assert [p.get("image") for p in content] == [path_bytes, raw_bytes, expected_pil.getvalue(), None]
    assert content[3] == {"type": "text", "text": "Look"}


@pytest.mark.parametrize("raised, error_type", [
    (errors.InvalidRequest, InvalidRequest), (errors.Overloaded, Overloaded), (errors.Unavailable, Unavailable),
    (errors.DeadlineExceeded, DeadlineExceeded), (errors.InternalError, EPDError)])
def test_router_errors_map_to_typed_errors(address, core, raised, error_type):
    status = raised.code.http_status
    core.error = raised("scripted", retry_after_s=0.25 if status == 429 else None)

    async def main():
        async with AsyncEPDClient(address) as client:
            await client.chat("Hi")

    with pytest.raises(error_type, match="scripted") as info:
        run(main())
    if status == 429:
        assert info.value.retry_after_s == 0.25
        assert info.value.grpc_status() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_timeout_is_deadline_exceeded_and_cancels_the_core(address, core):
    core.is_hanging = True

    async def main():
        async with AsyncEPDClient(address, timeout_s=0.5) as client:
            await client.chat("Hi")

    with pytest.raises(DeadlineExceeded):
        run(main())
    assert core.closed.wait(WAIT_S)


def test_closing_a_stream_midway_closes_the_core_iterator(address, core):
    core.is_hanging = True

    async def main():
        async with AsyncEPDClient(address) as client:
            async with client.stream("Hi") as stream:
                return (await anext(stream)).text

    assert run(main()) == "Hel"
    assert core.closed.wait(WAIT_S)
    assert not core.finished.is_set()


def test_cancelling_the_reading_task_cancels_the_request(address, core):
    core.is_hanging = True

    async def main():
        async with AsyncEPDClient(address) as client:
            first = asyncio.Event()

            async def consume():
                async for _ in client.stream("Hi"):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(main())
    assert core.closed.wait(WAIT_S)


def test_models_and_health(address):
    async def main():
        async with AsyncEPDClient(address) as client:
            return await client.models(), await client.health()

    models, health = run(main())
    assert models == ["fake-vl"]
    assert health.status == "degraded" and len(health.workers) == 2
