"""Per-step streams between the router and a decode worker: one message per engine step for all of
a worker's requests (counted, not timed), a lagging reader's tokens in one piece, a request's
failure after its tokens, and the stream's end reaching every request on it."""
from __future__ import annotations

import asyncio
import threading
import time

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


def test_a_channel_merges_plain_tokens_from_the_columns_with_steps_in_order():
    async def run():
        channel = StepChannel()
        channel.push(7)  # a step's plain token, as the columns bring it
        alone = await channel.next()
        channel.push(1)
        channel.push(_step(tokens=[2, 3]))
        channel.push(4)
        merged = await channel.next()
        channel.push(5)
        channel.push(_step(tokens=[6], finish="stop"))
        last = await channel.next()
        failing = StepChannel()
        failing.push(8)
        failing.push(_step(error="INTERNAL"))
        before_error = await failing.next()
        with pytest.raises(StepError):
            await failing.next()
        return alone, merged, last, before_error

    alone, merged, last, before_error = asyncio.run(run())
    assert (alone.token_ids, alone.logprobs, alone.finish_reason) == ([7], [], None)
    assert (merged.token_ids, merged.finish_reason) == ([1, 2, 3, 4], None)
    assert (last.token_ids, last.finish_reason) == ([5, 6], "stop")
    assert before_error.token_ids == [8]


def test_a_channel_with_a_stream_interval_wakes_its_reader_every_n_tokens_or_at_a_finish_or_error():
    """``--stream-interval 3``: tokens below the interval wait without waking the reader (its task is
    still waiting after the loop ran every callback); the third wakes it with all three; a finish
    or an error wakes it at once, the tokens before it first; a reader coming back to tokens not yet
    due waits too."""
    async def settle():
        for _ in range(5):
            await asyncio.sleep(0)

    async def run():
        channel = StepChannel(wake_every=3)
        reader = asyncio.ensure_future(channel.next())
        channel.push(1)
        channel.push(_step(tokens=[]))  # a step without a token (nothing new for it)
        channel.push(2)
        await settle()
        held = not reader.done()
        channel.push(3)
        group = await asyncio.wait_for(reader, 5)
        channel.push(4)  # read before it is due: the reader waits for more
        early = asyncio.ensure_future(channel.next())
        await settle()
        waited = not early.done()
        channel.push(_step(tokens=[5], finish="stop"))
        last = await asyncio.wait_for(early, 5)
        failing = StepChannel(wake_every=3)
        failing.push(6)
        failing.push(_step(error="INTERNAL"))
        before_error = await asyncio.wait_for(failing.next(), 5)
        with pytest.raises(StepError):
            await failing.next()
        lost = StepChannel(wake_every=3)
        lost.push(7)
        lost.push(UpstreamError("decode x ended the stream"))
        tokens_first = await asyncio.wait_for(lost.next(), 5)
        with pytest.raises(UpstreamError):
            await lost.next()
        return held, group, waited, last, before_error, tokens_first

    held, group, waited, last, before_error, tokens_first = asyncio.run(run())
    assert held and group.token_ids == [1, 2, 3]
    assert waited and (last.token_ids, last.finish_reason) == ([4, 5], "stop")
    assert before_error.token_ids == [6] and tokens_first.token_ids == [7]


def test_the_engine_loop_sends_plain_tokens_as_columns_and_the_rest_as_updates():
    """A running sequence's one new token goes to a columns batch as (key, token); a sequence that
    finished, asks for logprobs, failed, or got two tokens since its last update goes as an update,
    and so does everything for a batch whose router did not ask for columns (an older router would
    drop the columns)."""
    from epd.engine.engine_loop import EngineLoop, _Watcher
    from epd.engine.sequence import Sequence, SequenceStatus
    from epd.types import SamplingParams, TokenLogprobs

    def running(name, outputs, **params):
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=64, **params), request_id=name)
        seq.status = SequenceStatus.RUNNING
        for token in outputs:
            seq.append_token(token, TokenLogprobs(token, -0.5, []) if params.get("logprobs") is not None else None)
        return seq

    def published(columns: bool):
        handed = []
        sink = StepSink(None, None)
        sink.columns = columns
        sink._hand_over = lambda *args: handed.append(args)  # what reaches the event loop
        loop = EngineLoop(engine=None)
        seqs = {"plain": running("plain", [10, 11]), "two": running("two", [20, 21, 22]),
                "logprobs": running("logprobs", [30, 31], logprobs=0), "done": running("done", [40, 41]),
                "failed": running("failed", [50, 51])}
        seqs["done"].status, seqs["done"].finish_reason = SequenceStatus.FINISHED, "length"
        seqs["failed"].error = "device lost"
        sent = {"plain": 1, "two": 1, "logprobs": 1, "done": 1, "failed": 1}
        for name, seq in seqs.items():
            loop._watchers[seq.seq_id] = _Watcher(seq, sink.updates_for(name), sent[name])
        loop._publish_step()
        loop._flush_batches()
        (args,) = handed
        pending, keys, tokens = args
        return {rid: (u.token_ids, u.finish_reason, u.error, len(u.logprobs)) for rid, u in pending}, keys, tokens

    updates, keys, tokens = published(columns=True)
    assert (keys, tokens) == (["plain"], [11])
    assert updates == {"two": ([21, 22], None, None, 0), "logprobs": ([31], None, None, 1),
                       "done": ([41], "length", None, 0), "failed": ([], None, "device lost", 0)}
    updates, keys, tokens = published(columns=False)
    assert (keys, tokens) == ([], []) and updates["plain"] == ([11], None, None, 0) and len(updates) == 5


def test_a_grouped_requests_plain_tokens_wait_in_the_sequence_until_its_group_is_complete():
    """A request whose router groups its tokens by 4: this worker's first token goes out alone (its
    KV import is let go of then), the next ones wait in the sequence until the request has 1 + 4k
    output tokens, as the router counts its groups, then go out together as columns, in order; its
    finish takes what is left. An ungrouped request beside it goes out every step."""
    from epd.engine.engine_loop import EngineLoop, _Watcher
    from epd.engine.sequence import Sequence, SequenceStatus
    from epd.types import SamplingParams

    handed = []
    sink = StepSink(None, None)
    sink.columns = True
    sink._hand_over = lambda *args: handed.append(args)
    loop = EngineLoop(engine=None)
    seqs = {}
    for name, group in (("grouped", 4), ("plain", 1)):
        seq = seqs[name] = Sequence([1, 2, 3], SamplingParams(max_tokens=64), request_id=name)
        seq.status = SequenceStatus.RUNNING
        seq.append_token(100)  # the first output token, prefill's: the router has it
        loop._watchers[seq.seq_id] = _Watcher(seq, sink.updates_for(name, group), 1)
    out: dict[str, list[list[int]]] = {"grouped": [], "plain": []}
    for step in range(2, 12):  # output tokens 2..11, one a step
        for seq in seqs.values():
            seq.append_token(100 + step)
        if step == 11:
            seqs["grouped"].status, seqs["grouped"].finish_reason = SequenceStatus.FINISHED, "length"
        handed.clear()
        loop._publish_step()
        loop._flush_batches()
        for pending, keys, tokens in handed:
            for name in out:
                got = [t for k, t in zip(keys, tokens) if k == name] + [t for rid, u in pending if rid == name
                                                                        for t in u.token_ids]
                if got:
                    out[name].append(got)
    assert out["grouped"] == [[102], [103, 104, 105], [106, 107, 108, 109], [110, 111]]
    assert out["plain"] == [[100 + step] for step in range(2, 12)]


def test_the_columns_leave_out_forgotten_requests_and_let_go_of_a_first_updates_import():
    from types import SimpleNamespace

    from epd.decode.servicer import _RouterStream
    from epd.decode.step_stream import StreamRequest

    class Held:
        def __init__(self):
            self.released = 0

        def release_soon(self):
            self.released += 1

    async def run():
        servicer = SimpleNamespace(metrics=SimpleNamespace(requests=None))
        stream = _RouterStream(servicer)
        imports = {}
        for rid in ("a", "b"):
            stream.requests[rid] = StreamRequest(rid, imported=Held())
            imports[rid] = stream.requests[rid].imported
        stream.unreleased = {"a"}  # b had its first update already
        stream._deliver([], ["a", "gone", "b"], [1, 2, 3])
        first = stream.outbox.get_nowait()
        stream._deliver([], ["a", "b"], [4, 5])
        second = stream.outbox.get_nowait()
        return stream, imports, first, second

    stream, imports, first, second = asyncio.run(run())
    assert (list(first.token_request_ids), list(first.tokens)) == (["a", "b"], [1, 3])
    assert (list(second.token_request_ids), list(second.tokens)) == (["a", "b"], [4, 5])
    assert not first.requests and stream.unreleased == set()
    assert imports["a"].released == 1 and stream.requests["a"].kv_written and stream.requests["a"].imported is None
    # b was no longer in unreleased: its import is the tier's to let go of elsewhere, not here
    assert imports["b"].released == 0


def test_plain_steps_leave_from_the_engine_thread_and_the_rest_through_the_loop_in_order():
    """On the plain TCP link a step of plain tokens is sent by the engine thread itself; a step
    with a new request (its import to let go of), a finish or a forgotten request goes through
    the loop, and the steps after it too until the loop sent it."""
    from types import SimpleNamespace

    from epd.decode.servicer import _RouterStream
    from epd.decode.step_stream import StreamRequest

    class Sender:  # FrameSender's side of it: declines while a step is owed
        def __init__(self):
            self.direct, self.by_loop, self.owed = [], [], 0

        def try_send(self, data):
            if self.owed:
                return False
            self.direct.append(decode_pb2.StepBatch.FromString(data[4:]))
            return True

        def send(self, batch):
            self.by_loop.append(batch)

        def owe(self):
            self.owed += 1

        def paid(self):
            self.owed -= 1

    class Held:
        released = 0

        def release_soon(self):
            self.released += 1

    finished = []
    metrics = SimpleNamespace(requests=SimpleNamespace(labels=lambda reason: SimpleNamespace(
        inc=lambda: finished.append(reason))))

    async def run():
        sender = Sender()
        stream = _RouterStream(SimpleNamespace(metrics=metrics), sender)
        held = Held()
        for rid in "ab":
            stream.requests[rid] = StreamRequest(rid, imported=held if rid == "a" else None)
        stream.unreleased = {"a"}
        sink = stream.sink
        sink.columns = True

        def engine(*steps):
            def run_steps():
                for step in steps:
                    for key, token in step:
                        if isinstance(token, TokenUpdate):
                            sink.updates_for(key).put(token)
                        else:
                            sink.add_token(key, token)
                    sink.flush()
            thread = threading.Thread(target=run_steps)
            thread.start()
            thread.join()

        engine([("a", 1), ("b", 2)], [("a", 3), ("b", 4)])  # a's first token; the next step waits behind it
        owed_meanwhile = sender.owed
        await asyncio.sleep(0.05)
        engine([("a", 5), ("b", 6)],  # plain: out from the engine thread
               [("a", 7), ("b", TokenUpdate([8], finish_reason="stop"))],  # b finishes: the loop's
               [("a", 10)],  # plain, but behind the finish the loop has not sent yet
               [("gone", 9)])  # a request the router forgot: nothing goes out for it
        await asyncio.sleep(0.05)
        return sender, stream, held, owed_meanwhile

    sender, stream, held, owed_meanwhile = asyncio.run(run())
    columns = [(list(b.token_request_ids), list(b.tokens)) for b in sender.by_loop]
    assert owed_meanwhile == 2 and sender.owed == 0
    assert columns == [(["a", "b"], [1, 2]), (["a", "b"], [3, 4]), (["a"], [7]), (["a"], [10])]
    assert [(s.request_id, list(s.token_ids), s.finish_reason) for s in sender.by_loop[2].requests] == \
        [("b", [8], "stop")]
    assert [(list(b.token_request_ids), list(b.tokens)) for b in sender.direct] == [(["a", "b"], [5, 6])]
    assert held.released == 1 and not stream.unreleased and finished == ["stop"]


def test_a_sink_hands_over_a_steps_updates_in_one_call_on_the_event_loop():
    async def run():
        delivered = []
        sink = StepSink(asyncio.get_running_loop(), lambda *args: delivered.append(args))
        sink.columns = True

        def engine_thread():  # two steps of three requests, as the engine loop publishes them
            for step in range(2):
                for request_id in "ab":
                    sink.updates_for(request_id).put(TokenUpdate([step]))
                sink.add_token("c", 10 + step)  # a plain token, in the columns
                sink.flush()
            sink.flush()  # a step that gave nobody anything: nothing to hand over

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        await asyncio.sleep(0.05)
        return delivered

    delivered = asyncio.run(run())
    assert [([(rid, u.token_ids) for rid, u in pending], keys, tokens) for pending, keys, tokens in delivered] == \
        [([("a", [0]), ("b", [0])], ["c"], [10]), ([("a", [1]), ("b", [1])], ["c"], [11])]


@pytest.mark.slow
def test_one_message_per_engine_step_per_decode_worker_whatever_the_number_of_streams():
    """16 requests at once on one decode worker: the router receives at most one message per engine
    step of that worker (a message per request per step would be 16 times as many), on the TCP link
    the worker offers (the default) and on the gRPC call (``decode_link: grpc``) alike."""
    from epd.bench.pipeline_costs import EngineMeter
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

                ran, started_s = [], time.perf_counter()  # the engine's busy time, as the profile reads it
                engine_ms = EngineMeter(metrics).ms_per_step(lambda: ran.append(router.run(all_of_them())))
                wall_s, counts = time.perf_counter() - started_s, ran[0]
                steps = sample_sum(scrape(metrics), "epd_engine_steps_total") - steps_before
                batch_steps = sample_sum(scrape(metrics), "epd_engine_batch_steps_total") - batch_steps_before
                link = router.pipeline.backend.decode_links[cluster.decodes[0]]
                seen[decode_link] = (counts, steps, batch_steps, link.num_batches,
                                     isinstance(link._call, TcpStreamCall), link.num_column_tokens,
                                     engine_ms, 1000 * wall_s / steps)
    for decode_link, (counts, steps, batch_steps, num_batches, over_tcp, column_tokens, engine_ms,
                      wall_ms) in seen.items():
        assert counts == [num_tokens] * num_requests, decode_link
        # epd_engine_step_seconds counts the engine's own time: some, and less than a step's wall time
        assert engine_ms is not None and 0 < engine_ms < wall_ms, (decode_link, engine_ms, wall_ms)
        # the steps' plain tokens came as the batches' columns: all but each request's last
        # (its finish) and first (from prefill)
        assert column_tokens == num_requests * (num_tokens - 2), (decode_link, column_tokens)
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
