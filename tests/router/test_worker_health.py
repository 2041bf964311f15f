"""The router's view of worker health, against real grpc.aio servers on 127.0.0.1 whose Health answers
the test scripts: a busy worker that answers and progresses stays in rotation however loaded; one
that holds work and stops progressing, or stops answering, leaves it; one that answers again
comes back. Plus the encoder's push batching: pushes queued while a call is in flight share one."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from epd.encoder.servicer import PushBatcher
from epd.errors import InvalidRequest
from epd.router.workers import WorkerRegistry
from epd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, tensor_pb2
from epd.wire.rpc import SERVER_OPTIONS


class _ScriptedDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self) -> None:
        self.health = common_pb2.HealthResponse(status="SERVING", tier="decode")
        self.silent = False

    async def Health(self, request, context):
        if self.silent:
            await asyncio.sleep(10)  # longer than the registry's timeout: no answer
        return self.health


class _CountingPrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, tier: str = "prefill", model: str = "m") -> None:
        self.calls: list[int] = []  # pushes per call
        self.gate = asyncio.Event()
        self.health = common_pb2.HealthResponse(tier=tier, model=model)
        self.holds: set[str] = set()  # request ids it expects; the others' leases come back
        self.health_gate: asyncio.Event | None = None  # set: Health waits for it

    async def PushEmbeddings(self, request, context):
        self.calls.append(len(request.pushes))
        await self.gate.wait()  # hold the first call open while more pushes queue
        refused = [p.embedding.lease_id for p in request.pushes if p.request_id not in self.holds]
        return prefill_pb2.PushEmbeddingsResponse(num_accepted=len(request.pushes) - len(refused),
                                                  refused_lease_ids=refused)

    async def Health(self, request, context):
        if self.health_gate is not None:
            await self.health_gate.wait()
        return self.health


async def _serve(add, servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@contextlib.asynccontextmanager
async def _watched_decode(**registry_options):
    """A scripted decode worker and a started registry watching it; both stopped after."""
    decode = _ScriptedDecode()
    server, address = await _serve(decode_pb2_grpc.add_DecodeServicer_to_server, decode)
    registry = WorkerRegistry({"decode": [address]}, **registry_options)
    try:
        await registry.start()
        yield decode, registry, address
    finally:
        await registry.close()
        await server.stop(0)


def test_a_loaded_worker_that_progresses_stays_in_rotation():
    async def run():
        async with _watched_decode(health_timeout_s=0.5, stall_timeout_s=0.3) as (decode, registry, address):
            for step in range(6):  # heavily loaded, but every check sees new steps
                decode.health = common_pb2.HealthResponse(num_running=900, num_waiting=4000, num_steps=step + 1)
                await asyncio.sleep(0.1)
                await registry.check_all()
                assert [c.address for c in registry.candidates("decode")] == [address]
            assert registry.candidates("decode")[0].load >= 4000  # routed by the load it reports
    _run(run())


def test_a_worker_that_holds_work_and_stops_progressing_leaves_and_comes_back():
    async def run():
        async with _watched_decode(health_timeout_s=0.5, stall_timeout_s=0.3) as (decode, registry, _):
            decode.health = common_pb2.HealthResponse(num_running=3, num_steps=7)
            await _checks(registry, 5)
            assert registry.candidates("decode") == []  # stuck: answers, but its steps stand still
            decode.health = common_pb2.HealthResponse(num_running=3, num_steps=8)
            await registry.check_all()
            assert len(registry.candidates("decode")) == 1
            decode.health = common_pb2.HealthResponse(num_running=0, num_steps=8)  # idle is not stuck
            await _checks(registry, 5)
            assert len(registry.candidates("decode")) == 1
    _run(run())


def test_a_workers_busy_share_is_read_from_two_health_answers():
    """The share of the time between two answers that the worker's engine worked: the change of its
    busy seconds over the time between them, at most 1; not known from one answer, from a worker
    that does not count it, or when its count went back (a new process at that address)."""
    async def run():
        async with _watched_decode(health_timeout_s=2.0) as (decode, registry, _):
            w = registry.workers["decode"][0]
            assert w.busy_fraction is None  # the registry's first answer: no field
            decode.health = common_pb2.HealthResponse(busy_seconds=10.0)
            await registry.check_all()
            assert w.busy_fraction is None  # one answer with it: nothing to compare yet
            await asyncio.sleep(0.2)
            decode.health = common_pb2.HealthResponse(busy_seconds=10.1)
            await registry.check_all()
            assert 0.02 < w.busy_fraction <= 0.5  # 0.1 s of work in 0.2 s or a little more
            assert w.as_dict()["busy"] == round(w.busy_fraction, 3)
            decode.health = common_pb2.HealthResponse(busy_seconds=60.0)  # more than the wall time: at most 1
            await registry.check_all()
            assert w.busy_fraction == 1.0
            decode.health = common_pb2.HealthResponse(busy_seconds=0.5)  # went back: a restarted worker
            await registry.check_all()
            assert w.busy_fraction is None
            await asyncio.sleep(0.1)
            decode.health = common_pb2.HealthResponse(busy_seconds=0.5)  # idle since
            await registry.check_all()
            assert w.busy_fraction == 0.0
            decode.health = common_pb2.HealthResponse()  # stopped counting it
            await registry.check_all()
            assert w.busy_fraction is None and "busy" not in w.as_dict()
    _run(run())


async def _checks(registry: WorkerRegistry, times: int) -> None:
    for _ in range(times):
        await asyncio.sleep(0.1)
        await registry.check_all()


def test_a_worker_that_does_not_answer_leaves_after_three_checks():
    async def run():
        async with _watched_decode(health_timeout_s=0.2) as (decode, registry, _):
            decode.silent = True
            for expected in (1, 1, 0):
                await registry.check_all()
                assert len(registry.candidates("decode")) == expected
            decode.silent = False
            await registry.check_all()
            assert len(registry.candidates("decode")) == 1
    _run(run())


def test_pushes_queued_while_a_call_is_in_flight_share_the_next_call():
    num_waiting = 3

    async def run():
        prefill = _CountingPrefill()
        server, address = await _serve(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill)
        batcher = PushBatcher("m")
        push = [prefill_pb2.PushEmbeddingsRequest().pushes.add()]  # one (empty) push per caller
        try:
            first = asyncio.create_task(batcher.push(address, push, 10))
            while not prefill.calls:
                await asyncio.sleep(0.01)
            others = [asyncio.create_task(batcher.push(address, push, 10)) for _ in range(num_waiting)]
            await asyncio.sleep(0.1)
            prefill.gate.set()
            await asyncio.gather(first, *others)
            assert prefill.calls == [1, num_waiting]  # not one call per caller
        finally:
            await server.stop(0)
    _run(run())


@pytest.mark.parametrize("tier, model", [("decode", "m"), ("prefill", "other-model"), ("", "")],
                         ids=["a decode worker", "another model's prefill", "not EPD"])
def test_an_encoder_pushes_only_to_a_prefill_worker_of_its_model(tier, model):
    async def run():
        stranger = _CountingPrefill(tier, model)
        stranger.gate.set()
        server, address = await _serve(prefill_pb2_grpc.add_PrefillServicer_to_server, stranger)
        batcher = PushBatcher("m")
        try:
            with pytest.raises(InvalidRequest, match=rf"prefill_address {address} is not a prefill worker of "
                                                     r"model 'm' \(it answered as a .*\): nothing pushed"):
                await batcher.push(address, [prefill_pb2.PushEmbeddingsRequest().pushes.add()], 10)
            assert stranger.calls == []  # it got nothing but the health question
        finally:
            await server.stop(0)
    _run(run())


def test_leases_a_prefill_refuses_go_back_to_the_encoders_store():
    async def run():
        prefill = _CountingPrefill()
        prefill.gate.set()
        prefill.holds = {"held"}
        server, address = await _serve(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill)
        released: list[list[str]] = []
        batcher = PushBatcher("m", release=lambda ids, unused: released.append((ids, unused)))
        pushes = [common_pb2.EmbeddingPush(request_id=rid, embedding=tensor_pb2.TensorHandle(lease_id=lease))
                  for rid, lease in (("held", "lease-a"), ("gone", "lease-b"))]
        try:
            await batcher.push(address, pushes, 10)
            assert released == [(["lease-b"], True)]  # refused: never imported
        finally:
            await server.stop(0)
    _run(run())


def test_a_push_whose_caller_leaves_before_it_is_sent_gives_its_leases_back():
    async def run():
        prefill = _CountingPrefill()
        prefill.health_gate = asyncio.Event()  # its health answer (the destination check) waits
        server, address = await _serve(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill)
        released: list = []
        batcher = PushBatcher("m", release=lambda ids, unused: released.append((ids, unused)))
        pushes = [common_pb2.EmbeddingPush(request_id="r", embedding=tensor_pb2.TensorHandle(lease_id="lease-c"))]
        try:
            caller = asyncio.create_task(batcher.push(address, pushes, 10))
            await asyncio.sleep(0.2)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            assert released == [(["lease-c"], True)] and prefill.calls == []
        finally:
            prefill.health_gate.set()
            await server.stop(0)
    _run(run())


def test_a_failed_push_whose_caller_left_gives_its_leases_back():
    async def run():
        prefill = _CountingPrefill()  # its gate stays shut: the call hangs until its deadline
        server, address = await _serve(prefill_pb2_grpc.add_PrefillServicer_to_server, prefill)
        released: list[list[str]] = []
        batcher = PushBatcher("m", release=lambda ids, unused: released.append((ids, unused)))
        pushes = [common_pb2.EmbeddingPush(request_id="r", embedding=tensor_pb2.TensorHandle(lease_id="lease-a"))]
        try:
            caller = asyncio.create_task(batcher.push(address, pushes, 0.5))
            while not prefill.calls:
                await asyncio.sleep(0.01)
            caller.cancel()  # the Encode call was cancelled while its push was in flight
            with pytest.raises(asyncio.CancelledError):
                await caller
            for _ in range(100):  # the call fails at its 0.5 s deadline
                if released:
                    break
                await asyncio.sleep(0.02)
            assert released == [(["lease-a"], False)]  # the call failed: prefill may have imported it
        finally:
            prefill.gate.set()
            await server.stop(0)
    _run(run())
