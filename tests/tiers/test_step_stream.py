"""Per-step streams between the router and a decode worker: one message per engine step for all of
a worker's requests (counted, not timed), a lagging reader's tokens in one piece, a request's
failure after its tokens, and the stream's end reaching every request on it."""
from __future__ import annotations

import asyncio
import threading

import pytest

from epd.decode.step_stream import StepSink
from epd.engine.engine_loop import TokenUpdate
from epd.errors import UpstreamError
from epd.router.backends.decode_link import StepChannel, StepError
from epd.v1 import decode_pb2


def _step(request_id="r", tokens=(), finish="", error=""):
    return decode_pb2.RequestStep(request_id=request_id, token_ids=list(tokens), finish_reason=finish,
                                  error_status=error, error_message="failed" if error else "")


def test_a_channel_gives_what_piled_up_in_one_output_and_the_error_after_the_tokens():
    async def run():
        channel = StepChannel()
        channel.push(_step(tokens=[1, 2]))
        channel.push(_step(tokens=[3]))
        first = await channel.next()
        channel.push(_step(tokens=[4]))
        channel.push(_step(error="RESOURCE_EXHAUSTED"))
        second = await channel.next()
        with pytest.raises(StepError) as failed:
            await channel.next()
        ended = StepChannel()
        ended.push(_step(tokens=[5], finish="length"))
        ended.push(UpstreamError("stream gone"))  # after the finish: never read
        last = await ended.next()
        lost = StepChannel()
        lost.push(UpstreamError("decode x ended the stream"))
        with pytest.raises(UpstreamError, match="ended the stream"):
            await lost.next()
        return first, second, failed.value, last

    first, second, failed, last = asyncio.run(run())
    assert (first.token_ids, first.finish_reason) == ([1, 2, 3], None)
    assert second.token_ids == [4] and failed.status.name == "RESOURCE_EXHAUSTED"
    assert (last.token_ids, last.finish_reason) == ([5], "length")


def test_a_sink_hands_over_a_steps_updates_in_one_call_on_the_event_loop():
    async def run():
        delivered = []
        sink = StepSink(asyncio.get_running_loop(), delivered.append)

        def engine_thread():  # two steps of three requests, as the engine loop publishes them
            for step in range(2):
                for request_id in "abc":
                    sink.updates_for(request_id).put(TokenUpdate([step]))
                sink.flush()
            sink.flush()  # a step that gave nobody anything: nothing to hand over

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        await asyncio.sleep(0.05)
        return delivered

    delivered = asyncio.run(run())
    assert [[(rid, u.token_ids) for rid, u in batch] for batch in delivered] == \
        [[("a", [0]), ("b", [0]), ("c", [0])], [("a", [1]), ("b", [1]), ("c", [1])]]


@pytest.mark.slow
def test_one_message_per_engine_step_per_decode_worker_whatever_the_number_of_streams():
    """16 requests at once on one decode worker: the router receives at most one message per engine
    step of that worker (a message per request per step would be 16 times as many), on the TCP link
    the worker offers (the default) and on the gRPC call (``decode_link: grpc``) alike."""
    from epd.models.locate import resolve_model
    from epd.router.backends.tcp_stream import TcpStreamCall
    from epd.router.sync import SyncRouter
    from epd.server.local import LocalCluster
    from epd.types import ChatRequest, SamplingParams
    from tests.prom import sample_sum, scrape

    model_dir = resolve_model("null-qwen2-vl")
    num_requests, num_tokens = 16, 48
    seen = {}
    with LocalCluster(str(model_dir)) as cluster:
        metrics = next(f.split("=", 1)[1] for p in cluster.processes if p.tier == "decode" for f in p.ready_fields
                       if f.startswith("metrics="))
        for decode_link in ("tcp", "grpc"):
            with SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                         decodes=cluster.decodes, decode_link=decode_link) as router:
                steps_before = sample_sum(scrape(metrics), "epd_engine_steps_total")
                batch_steps_before = sample_sum(scrape(metrics), "epd_engine_batch_steps_total")

                async def one(i: int) -> int:
                    request = ChatRequest(messages=[{"role": "user", "content": f"Story {i}, please."}],
                                          sampling=SamplingParams(max_tokens=num_tokens), request_id=f"s{i}")
                    return sum([len(event.token_ids) async for event in router.pipeline.generate(request)])

                async def all_of_them():
                    return await asyncio.gather(*(one(i) for i in range(num_requests)))

                counts = router.run(all_of_them())
                steps = sample_sum(scrape(metrics), "epd_engine_steps_total") - steps_before
                batch_steps = sample_sum(scrape(metrics), "epd_engine_batch_steps_total") - batch_steps_before
                link = router.pipeline.backend.decode_links[cluster.decodes[0]]
                seen[decode_link] = (counts, steps, batch_steps, link.num_batches,
                                     isinstance(link._call, TcpStreamCall))
    for decode_link, (counts, steps, batch_steps, num_batches, over_tcp) in seen.items():
        assert counts == [num_tokens] * num_requests, decode_link
        # every request reaches decode with its KV: each joins the batch kept from step to step, and
        # no step is the scheduler's general one
        assert batch_steps == steps, (decode_link, batch_steps, steps)
        # a message per request per step would be one per token from decode whatever the steps; with
        # any two requests sharing a step (steps < those tokens) the counts tell the designs apart
        tokens_from_decode = num_requests * (num_tokens - 1)  # the first of each came from prefill
        assert steps < tokens_from_decode, f"{decode_link}: the requests never shared a step: nothing to tell apart"
        assert 0 < num_batches <= steps, (decode_link, num_batches, steps)
        assert over_tcp == (decode_link == "tcp")


def test_a_request_failing_with_an_unexpected_error_is_answered_and_let_go():
    """A device error or a bug while starting a request must reach the router as that request's
    failure (it would wait until its deadline otherwise), and the request must leave the stream."""
    from types import SimpleNamespace

    from epd.decode.servicer import _RouterStream
    from epd.server.admission import TierAdmission
    from epd.types import SamplingParams
    from epd.v1 import common_pb2
    from epd.wire.protocol import sampling_to_proto

    async def run():
        async def no_grammar(engine, sampling):
            return None

        async def broken_import(request_id, handle, timeout_s):
            raise RuntimeError("CUDA error: device lost")

        failures = []
        admission = TierAdmission("decode", 8, 1 << 30)
        servicer = SimpleNamespace(
            config=SimpleNamespace(request_timeout_s=5.0), _import=broken_import,
            ctx=SimpleNamespace(admission=admission, warm_grammar=no_grammar),
            metrics=SimpleNamespace(count_failure=failures.append), worker=SimpleNamespace(engine=None))
        stream = _RouterStream(servicer)
        meta = common_pb2.RequestMetadata(request_id="r1", token_ids=[1, 2],
                                          sampling=sampling_to_proto(SamplingParams(max_tokens=4)))
        stream._start(decode_pb2.GenerateRequest(request=meta), 5.0)
        batch = await asyncio.wait_for(stream.outbox.get(), 5)
        await asyncio.wait_for(stream.close(), 5)
        return batch, failures, stream.requests, admission.num_requests

    batch, failures, left, held = asyncio.run(run())
    (step,) = batch.requests
    assert (step.request_id, step.error_status) == ("r1", "INTERNAL") and "device lost" in step.error_message
    assert len(failures) == 1 and left == {} and held == 0
