"""The simulated router and workers: what each does with a request, in the order EPD does it.

- Router: one event loop; each request costs it ``ms_per_request`` (parsing, image headers, hashing)
  before dispatch and each streamed token ``ms_per_token``, each with the router process's CPU
  beyond them that ``epd profile --pipeline`` counted; a token reaches the client when the router
  has handled it, so a busy router delays every stream.
- The serving path's own costs (``epd profile --pipeline``: hops, HTTP, streaming) are added where
  they fall: per request before dispatch (on the way to its first token), per image on its way to
  prefill, per decode step on the decode worker, per streamed token on the router.
- The CPU the processes spend beyond all that (their gRPC and HTTP threads, serialization, image
  decoding; and the client's, when it shares the host: ``SimSettings.client_on_host``) is work on
  the host that gates no request: per request and image when it arrives, per streamed token when
  the router emits it, each at the count of requests in flight then (the profile measured it at two
  loads: requests that overlap share a step's message and their processes' wake-ups). It takes a
  share of the cores from whatever runs then.
- Every process that starts working after idling pays the profile's wake-up cost for that long an
  idle (``StageCosts.wake_ms``: near zero on a dedicated host, tens of ms on a virtual one).
- Encoder: items queue; an idle encoder takes every waiting item (up to ``encoder_batch_size``) as
  one batch. Its cache keeps every output (by image identity): a repeat costs nothing, an item
  already being encoded is waited for, not encoded again. Rows reach prefill after a transfer.
- Prefill: a request is computable once all its items' rows arrived; an idle prefill engine takes
  computable prompts in order into one step of at most ``max_num_batched_tokens`` (chunked prefill:
  a long prompt takes several steps). Its first token goes to the router, its KV to decode.
- Decode: continuous batching; every step gives each running request one token; a request joins at
  the next step after its KV arrived, up to ``max_num_seqs``.
- Aggregated: one engine does all of it on one thread: images are encoded between steps, and a step
  runs the decodes and a prefill chunk in the token budget left. The router's loop is in the same
  process: its work per request and per token takes turns with the engine's steps (one interpreter
  lock), where a router of its own runs beside the tiers.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from epd.plan.costs import StageCosts
from epd.plan.engine import Clock, Device


@dataclass
class SimRequest:
    index: int
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    images: tuple[tuple[int, float, int], ...] = ()  # (identity, pixels, embedding rows)
    # filled in as it runs
    rows_waiting: int = 0
    prefill_left: int = 0
    context: int = 0
    produced: int = 0
    token_ms: list[float] = field(default_factory=list)  # when the client got each token

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0] - self.arrival_ms

    @property
    def e2e_ms(self) -> float:
        return self.token_ms[-1] - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        n = len(self.token_ms)
        return (self.token_ms[-1] - self.token_ms[0]) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class SimSettings:
    encoder_batch_size: int = 32
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    router_ms_per_request: float = 1.0  # without router points in the profile
    router_ms_per_token: float = 0.07  # the tiny preset's, docs/benchmarks.md (control plane)
    row_bytes: int | None = None  # one embedding row; None: the profile's shapes (else 4 x 1,536)
    kv_bytes_per_token: int | None = None  # None: the profile's shapes (else 114,688)
    transport: str | None = None  # None: the profile's local transport (CUDA IPC, else shm)
    tp_efficiency: float = 0.8  # a TP-N worker's step: cost / (N x this), an assumption until measured
    client_on_host: bool = False  # the client runs on the cluster's host (a benchmark here): its CPU counts
    sampled: bool = True  # rows drawn at temperature > 0: the API's default 1 (epd bench sends no temperature)


class Router:
    def __init__(self, clock: Clock, device: Device, costs: StageCosts, settings: SimSettings,
                 threads: float = 1.0, aggregated: bool = False) -> None:
        self.clock, self.device, self.costs, self.settings, self.threads = clock, device, costs, settings, threads
        self.aggregated = aggregated
        # a streamed token's work beside the tiers: the profile's measured figure, else the setting
        self._path_ms_per_token = costs.path_ms(aggregated, "token_ms") or settings.router_ms_per_token
        self.in_flight = 0  # requests arrived and not finished: what the CPU beyond the stages depends on
        self._token_ms_at: dict[int, tuple[float, float]] = {}
        self._jobs: deque = deque()
        self._busy = False
        self._idle_since_ms = 0.0
        self.wakes = True  # pays the profile's wake-up cost after idling
        # the aggregated engine, whose process the router's loop shares: one interpreter lock, so
        # the loop's work and the engine's steps take turns instead of running side by side
        self.shares_lock_with = None

    def handle(self, work_ms: float, then) -> None:
        """Run ``then`` once the router's loop did ``work_ms`` of work (after what it had queued)."""
        if self.shares_lock_with is not None:
            self.shares_lock_with.serial(work_ms, then)
            return
        self._jobs.append((work_ms, then))
        self._kick()

    def _kick(self) -> None:
        if self._busy or not self._jobs:
            return
        work_ms, then = self._jobs.popleft()
        self._busy = True
        if self.wakes:
            work_ms += self.costs.wake_ms(self.clock.now_ms - self._idle_since_ms, engine=False)

        def done() -> None:
            self._busy = False
            self._idle_since_ms = self.clock.now_ms
            then()
            self._kick()
        self.device.start(work_ms, self.threads, "router", done)

    def tokens(self, requests: list[SimRequest]) -> None:
        """One step's tokens for ``requests`` reached the router: each client gets its token once handled."""
        def emit() -> None:
            for request in requests:
                request.token_ms.append(self.clock.now_ms)
        on_loop_ms, beside_ms = self._token_ms(self.in_flight)
        self.handle(on_loop_ms * len(requests), emit)
        self.background(beside_ms * len(requests))

    def _token_ms(self, in_flight: int) -> tuple[float, float]:
        """A streamed token's work (on the router's loop, beside it) at ``in_flight`` requests: read
        once a count, since every simulated step asks."""
        if in_flight not in self._token_ms_at:
            costs, aggregated = self.costs, self.aggregated
            self._token_ms_at[in_flight] = (
                self._path_ms_per_token + costs.cpu_beyond_ms(aggregated, "router", "token_ms", in_flight),
                costs.host_cpu_ms(aggregated, "token_ms", self.settings.client_on_host, in_flight))
        return self._token_ms_at[in_flight]

    def background(self, work_ms: float) -> None:
        """CPU on the host that no request waits for (``host_cpu_ms``)."""
        if work_ms > 0:
            self.device.start(work_ms, 1.0, "background", _nothing)


def _nothing() -> None:
    pass


class Worker:
    """A worker with one engine loop on ``device``, using ``threads`` of it while it computes."""

    tier = "worker"

    def __init__(self, name: str, clock: Clock, device: Device, costs: StageCosts, settings: SimSettings,
                 threads: float = 1.0, speedup: float = 1.0) -> None:
        self.name, self.clock, self.device, self.costs, self.settings = name, clock, device, costs, settings
        self.threads, self.speedup = threads, speedup
        self.busy = False
        self.idle_since_ms = 0.0  # when its last work ended (a worker idle a while starts cold)
        self.wakes = True  # pays the profile's wake-up cost after idling
        self.load = 0  # requests it holds (what the router balances)

    def _compute(self, work_ms: float, then) -> None:
        self.busy = True
        wake_ms = self.costs.wake_ms(self.clock.now_ms - self.idle_since_ms) if self.wakes else 0.0

        def done() -> None:
            self.busy = False
            self.idle_since_ms = self.clock.now_ms
            then()
            self.kick()
        self.device.start(work_ms / self.speedup + wake_ms, self.threads, self.name, done)

    def kick(self) -> None:
        raise NotImplementedError

    def _path_step_ms(self, aggregated: bool) -> float:
        """The serving path's own work per decode step (the profile's; without a measured per-token
        share, less the router's per token)."""
        if self.costs.path_ms(aggregated, "token_ms"):
            return self.costs.path_ms(aggregated, "step_ms")
        return max(0.0, self.costs.path_ms(aggregated, "step_ms") - self.settings.router_ms_per_token)


class Encoder(Worker):
    tier = "encoder"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queue: deque = deque()
        self.done: set[int] = set()
        self.pending: dict[int, list] = {}  # identity -> deliveries waiting for it

    def submit(self, identity: int, pixels: float, rows: int, deliver) -> None:
        if identity in self.done:
            self.clock.after(0.0, lambda: deliver(rows))
        elif identity in self.pending:
            self.pending[identity].append(deliver)
        else:
            self.pending[identity] = [deliver]
            self.queue.append((identity, pixels, rows))
            self.kick()

    def kick(self) -> None:
        if self.busy or not self.queue:
            return
        batch = [self.queue.popleft() for _ in range(min(len(self.queue), self.settings.encoder_batch_size))]
        # the forward, then the results handed on (the profile's, once a batch): the next batch waits
        work_ms = (sum(self.costs.encoder_ms(pixels, len(batch)) for _, pixels, _ in batch)
                   + self.costs.path_ms(False, "encoder_batch_ms"))

        def done() -> None:
            for identity, _, rows in batch:
                self.done.add(identity)
                for deliver in self.pending.pop(identity):
                    deliver(rows)
        self._compute(work_ms, done)


class Prefill(Worker):
    tier = "prefill"

    def __init__(self, *args, on_first_token, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_first_token = on_first_token
        self.ready: deque[SimRequest] = deque()

    def register(self, request: SimRequest) -> None:
        request.rows_waiting = len(request.images)
        request.prefill_left = request.prompt_tokens
        self.load += 1
        if not request.images:
            self.arrived(request)

    def rows_arrived(self, request: SimRequest, rows: int) -> None:
        # the rows' transfer and the image's path, less what of it the encoder already spent
        delay_ms = (self.costs.transfer_ms(self.settings.transport, rows * self.settings.row_bytes)
                    + max(self.costs.path_ms(False, "image_ms") - self.costs.path_ms(False, "encoder_batch_ms"), 0.0))

        def landed() -> None:
            request.rows_waiting -= 1
            if request.rows_waiting == 0:
                self.arrived(request)
        self.clock.after(delay_ms, landed)

    def arrived(self, request: SimRequest) -> None:
        self.ready.append(request)
        self.kick()

    def kick(self) -> None:
        if self.busy or not self.ready:
            return
        budget, step = self.settings.max_num_batched_tokens, []
        for request in self.ready:
            if budget <= 0:
                break
            take = min(request.prefill_left, budget)
            step.append((request, take))
            budget -= take
        tokens = sum(take for _, take in step)

        def done() -> None:
            for request, take in step:
                request.prefill_left -= take
                if request.prefill_left == 0:
                    self.ready.remove(request)
                    self.load -= 1
                    self.on_first_token(self, request)
        self._compute(self.costs.prefill_ms(tokens), done)


class Decode(Worker):
    tier = "decode"

    def __init__(self, *args, router: Router, on_finished, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.router, self.on_finished = router, on_finished
        self.joining: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []

    def add(self, request: SimRequest) -> None:
        self.load += 1
        self.joining.append(request)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        while self.joining and len(self.running) < self.settings.max_num_seqs:
            self.running.append(self.joining.popleft())
        if not self.running:
            return
        batch = list(self.running)
        context = sum(r.context for r in batch) / len(batch)

        def done() -> None:
            for request in batch:
                request.context += 1
                request.produced += 1
            self.router.tokens(batch)
            for request in [r for r in batch if r.produced >= r.output_tokens]:
                self.running.remove(request)
                self.load -= 1
                self.on_finished(request)
        self._compute(self.costs.served_step_ms(len(batch), context, self.settings.sampled) + self._path_step_ms(False),
                      done)


class Aggregated(Worker):
    """One engine on one thread: encodes between steps; a step is the decodes plus a prefill chunk."""

    tier = "aggregated"

    def __init__(self, *args, router: Router, on_finished, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.router, self.on_finished = router, on_finished
        self.encoder_cache: set[int] = set()
        self.to_encode: deque = deque()
        self.prefilling: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.router_jobs: deque = deque()

    def add(self, request: SimRequest) -> None:
        self.load += 1
        request.prefill_left = request.prompt_tokens
        request.rows_waiting = 0
        for identity, pixels, _ in request.images:
            if identity not in self.encoder_cache:
                request.rows_waiting += 1
                self.to_encode.append((identity, pixels, request))
        self.prefilling.append(request)
        self.kick()

    def serial(self, work_ms: float, then) -> None:
        """The router's work in this process: between two steps, before the next one."""
        self.router_jobs.append((work_ms, then))
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        if self.router_jobs:
            self._compute(*self.router_jobs.popleft())
            return
        if self.to_encode:
            batch = [self.to_encode.popleft() for _ in range(min(len(self.to_encode), self.settings.encoder_batch_size))]
            fresh = {identity: pixels for identity, pixels, _ in batch if identity not in self.encoder_cache}
            work_ms = sum(self.costs.encoder_ms(pixels, len(fresh)) + self.costs.path_ms(True, "image_ms")
                          for pixels in fresh.values())

            def encoded() -> None:
                self.encoder_cache.update(fresh)
                for _, _, request in batch:
                    request.rows_waiting -= 1
            self._compute(work_ms, encoded)
            return
        decodes = [r for r in self.running][: self.settings.max_num_seqs]
        budget = self.settings.max_num_batched_tokens - len(decodes)
        chunk = []
        for request in self.prefilling:
            if budget <= 0 or request.rows_waiting:
                break  # in order: a prompt waits for its images
            take = min(request.prefill_left, budget)
            chunk.append((request, take))
            budget -= take
        if not decodes and not chunk:
            return
        work_ms = self.costs.prefill_ms(sum(t for _, t in chunk)) if chunk else 0.0
        if decodes:
            work_ms += (self.costs.decode_ms(len(decodes), sum(r.context for r in decodes) / len(decodes),
                                             self.settings.sampled) + self._path_step_ms(True))

        def stepped() -> None:
            for request in decodes:
                request.context += 1
                request.produced += 1
            first = []
            for request, take in chunk:
                request.prefill_left -= take
                if request.prefill_left == 0:
                    self.prefilling.remove(request)
                    request.context, request.produced = request.prompt_tokens, 1
                    first.append(request)
            self.router.tokens(decodes + first)
            for request in decodes + first:
                if request.produced < request.output_tokens:
                    if request in first:
                        self.running.append(request)
                    continue
                if request in self.running:
                    self.running.remove(request)
                self.load -= 1
                self.on_finished(request)
        self._compute(work_ms, stepped)
