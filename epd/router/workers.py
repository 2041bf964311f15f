"""The router's view of its workers: health checked in the background, load counted locally.

Tier servers answer health on their event loop, which no request occupies, so a slow answer means
a worker in trouble, not a busy one. A worker leaves rotation when it does not answer
``unhealthy_after`` checks in a row, or when it holds work and its progress counter (engine steps,
encoder batches) stood still for ``stall_timeout_s``; one answering and progressing comes back.
Load = the router's in-flight requests on it + the queue the worker reports + its KV usage.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from epd.router.routing import Candidate
from epd.v1 import common_pb2, decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2_grpc
from epd.wire.rpc import open_channel

log = logging.getLogger("epd.router")

TIERS = ("encoder", "prefill", "decode")
_STUBS = {"encoder": encoder_pb2_grpc.EncoderStub, "prefill": prefill_pb2_grpc.PrefillStub,
          "decode": decode_pb2_grpc.DecodeStub}


@dataclass
class WorkerState:
    tier: str
    address: str
    channel: grpc.aio.Channel
    healthy: bool = False
    draining: bool = False  # being removed: no new requests, in-flight ones finish
    stopping: bool = False  # the worker says it is draining (its SIGTERM): no new requests, in-flight ones finish
    consecutive_failures: int = 0
    in_flight: int = 0
    last_health: common_pb2.HealthResponse = field(default_factory=common_pb2.HealthResponse)
    progress_at_s: float = field(default_factory=time.monotonic)  # last check that saw progress, or no work
    # the share of the time between its last two answers that its engine worked (None: not known yet,
    # or a worker that does not count it)
    busy_fraction: float | None = None
    _busy_at: tuple[float, float] | None = field(default=None, repr=False)  # (its busy seconds, when read)
    tls: object = field(default=None, repr=False)  # the router's certificates (epd.wire.tls.MutualTls), for links not gRPC
    # resolved when the worker leaves rotation: calls waiting on it give up then (see ``outage``)
    _left_rotation: asyncio.Future | None = field(default=None, repr=False)

    @property
    def stub(self):
        return _STUBS[self.tier](self.channel)

    @property
    def host_id(self) -> str:
        """The host whose memory the worker shares (from its health answers; "" before the first)."""
        return self.last_health.host_id

    @property
    def load(self) -> float:
        return self.in_flight + self.last_health.num_waiting + self.last_health.kv_usage

    def as_dict(self) -> dict:
        h = self.last_health
        return {"address": self.address, "healthy": self.healthy, "draining": self.draining or self.stopping,
                "in_flight": self.in_flight, "held": h.num_held_requests, "running": h.num_running,
                "waiting": h.num_waiting, "kv_usage": round(h.kv_usage, 4), "steps": h.num_steps,
                **({"busy": round(self.busy_fraction, 3)} if self.busy_fraction is not None else {}),
                "host_id": h.host_id, **({"reads_encoder_store": True} if h.reads_encoder_store else {}),
                **({"uses_encoder_store": True} if h.uses_encoder_store else {})}

    def set_healthy(self, healthy: bool) -> None:
        # a worker that said it was stopping went away after finishing what it held: the calls the
        # router is still reading (answers buffered on this side) end on their own, none is moved;
        # a call it really lost fails with its error and moves that way
        if not healthy and not self.stopping and self._left_rotation is not None and not self._left_rotation.done():
            self._left_rotation.set_result(None)
        self.healthy = healthy

    def outage(self) -> asyncio.Future:
        """A future resolved when the worker leaves rotation (it died, stopped answering health or
        stalled), already resolved while it is out: a call waiting on it gives up then and the
        request moves on, instead of waiting on a wedged worker until its deadline."""
        if self._left_rotation is None or (self._left_rotation.done() and self.healthy):
            self._left_rotation = asyncio.get_running_loop().create_future()
            if not self.healthy:
                self._left_rotation.set_result(None)
        return self._left_rotation

    def note_busy(self, health: common_pb2.HealthResponse, now_s: float) -> None:
        """The share of the time since the last answer that the worker's engine worked: how much of
        it a tier really uses, where the requests counted at one instant say little (an encoder whose
        batches come and go between two looks shows none running at either)."""
        if not health.HasField("busy_seconds"):
            self.busy_fraction, self._busy_at = None, None
            return
        busy_s, last = health.busy_seconds, self._busy_at
        if last is not None and busy_s >= last[0] and now_s > last[1]:
            self.busy_fraction = min((busy_s - last[0]) / (now_s - last[1]), 1.0)
        elif last is not None:  # its count went back: a new process at this address; from the next answer
            self.busy_fraction = None
        self._busy_at = (busy_s, now_s)

    def note_progress(self, health: common_pb2.HealthResponse, now_s: float) -> None:
        """Progress: the counter moved, or the worker has nothing to compute (idle is not stuck;
        an encoder's running requests only hold finished rows)."""
        busy = health.num_waiting if self.tier == "encoder" else health.num_running
        if health.num_steps != self.last_health.num_steps or not busy:
            self.progress_at_s = now_s


class WorkerRegistry:
    def __init__(self, workers: dict[str, list[str]], *, health_period_s: float = 1.0,
                 health_timeout_s: float = 5.0, unhealthy_after: int = 3, stall_timeout_s: float = 60.0,
                 tls=None) -> None:
        """``tls``: an ``epd.wire.tls.MutualTls`` when the tiers demand client certificates."""
        self._tls = tls
        self._initial = {tier: list(addresses) for tier, addresses in workers.items()}
        self.workers: dict[str, list[WorkerState]] = {tier: [] for tier in workers}
        self.health_period_s, self.health_timeout_s = health_period_s, health_timeout_s
        self.unhealthy_after, self.stall_timeout_s = unhealthy_after, stall_timeout_s
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the channels (on the running loop: grpc.aio channels belong to one) and check all."""
        self.workers = {tier: [self._state(tier, a) for a in addresses] for tier, addresses in self._initial.items()}
        await self.check_all()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for states in self.workers.values():
            for w in states:
                await w.channel.close()

    def candidates(self, tier: str, host_id: str | None = None) -> list[Candidate]:
        """The workers of ``tier`` in rotation; with ``host_id``, only those on that host."""
        return [Candidate(w.address, w.load) for w in self.workers.get(tier, [])
                if w.healthy and not w.draining and not w.stopping and host_id in (None, w.host_id)]

    async def add(self, tier: str, address: str, *, expected_model: str | None = None) -> WorkerState:
        """Register a new worker (scale-up) once it answers EPD's health RPC as ``tier`` (and, when
        given, as ``expected_model``); ValueError otherwise: an address that is not such a worker
        never gets traffic. It enters rotation at once."""
        if tier not in _STUBS:
            raise ValueError(f"unknown tier {tier!r}; expected one of {sorted(_STUBS)}")
        existing = [w for w in self.workers.setdefault(tier, []) if w.address == address]
        if existing:
            existing[0].draining = False
            return existing[0]
        w = self._state(tier, address)
        try:
            health = await w.stub.Health(common_pb2.HealthRequest(), timeout=self.health_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as err:
            await w.channel.close()
            code = err.code().name if isinstance(err, grpc.aio.AioRpcError) else "timeout"
            raise ValueError(f"{address} does not answer EPD's {tier} health RPC ({code})") from None
        if health.tier != tier or (expected_model is not None and health.model != expected_model):
            await w.channel.close()
            raise ValueError(f"{address} is a {health.tier or 'unknown'} worker of model {health.model!r}; expected "
                             f"a {tier} worker of model {expected_model!r}")
        self.workers[tier].append(w)
        await self._check(w, health)
        return w

    async def remove(self, tier: str, address: str, drain_timeout_s: float = 60.0) -> bool:
        """Scale-down: stop routing to the worker, wait for its in-flight requests, forget it.
        Returns whether it drained within the timeout (it is removed either way)."""
        w = self.get(tier, address)
        w.draining = True
        deadline = asyncio.get_running_loop().time() + drain_timeout_s
        while w.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self.workers[tier].remove(w)
        await w.channel.close()
        return w.in_flight == 0

    def get(self, tier: str, address: str) -> WorkerState:
        return next(w for w in self.workers[tier] if w.address == address)

    def healthy_counts(self) -> dict[str, int]:
        return {tier: sum(w.healthy for w in states) for tier, states in self.workers.items()}

    def mark_failed(self, tier: str, address: str) -> None:
        """A call failed with UNAVAILABLE: take the worker out now, health checks bring it back."""
        w = next((w for w in self.workers.get(tier, []) if w.address == address), None)
        if w is None:
            return  # removed (drained) meanwhile
        if w.healthy:
            log.warning("%s %s stopped answering; out of rotation", tier, address)
        w.set_healthy(False)
        w.consecutive_failures = max(w.consecutive_failures, self.unhealthy_after)

    def _state(self, tier: str, address: str) -> WorkerState:
        return WorkerState(tier, address, open_channel(address, self._tls, aio=True), tls=self._tls)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for states in self.workers.values() for w in states))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_period_s)
            await self.check_all()

    async def _check(self, w: WorkerState, health: common_pb2.HealthResponse | None = None) -> None:
        """Ask ``w`` for its health (or take ``health``, just asked) and judge it."""
        try:
            if health is None:
                health = await w.stub.Health(common_pb2.HealthRequest(), timeout=self.health_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            w.consecutive_failures += 1
            if w.healthy and w.consecutive_failures >= self.unhealthy_after:
                log.warning("%s %s failed %d health checks; out of rotation", w.tier, w.address,
                            w.consecutive_failures)
                w.set_healthy(False)
            return
        now_s = time.monotonic()
        w.note_progress(health, now_s)
        w.note_busy(health, now_s)
        w.last_health, w.consecutive_failures = health, 0
        if (health.status == "DRAINING") != w.stopping:
            log.info("%s %s %s", w.tier, w.address, "is draining: no new requests" if health.status == "DRAINING"
                     else "serves again")
            w.stopping = health.status == "DRAINING"
        stalled_s = now_s - w.progress_at_s
        if stalled_s > self.stall_timeout_s:
            if w.healthy:
                log.warning("%s %s made no progress for %.0f s with work in hand; out of rotation", w.tier,
                            w.address, stalled_s)
            w.set_healthy(False)
            return
        if not w.healthy:
            log.info("%s %s is healthy; in rotation", w.tier, w.address)
        w.set_healthy(True)

