"""``epd profile --pipeline``: what the serving path costs beyond the stages themselves, measured on
a real ``epd serve`` here (the tiers, then ``--aggregated``) with one request at a time, sent by
``epd bench``'s own client as a bench run sends them (sampled: no temperature): the hops between
processes, HTTP and streaming. For each: the TTFT of a text request and of one with an image,
and the time per output token, minus what the profile's stage costs account for (a prefill of that
prompt, the encoder's forward, a sampled decode step), as figures a simulator adds:

- ``request_ms``: on every request's way to its first token;
- ``image_ms``: per image, on its way from the router to prefill (the encode call and the push);
- ``step_ms``: per decode step, on the decode worker (its output path);
- ``handoff_ms``: once a request, between its first token (prefill's) and its first decode step,
  beyond the KV transfer the simulator charges (the tiers only): told from ``step_ms`` by the time
  per token of text requests of two output lengths (a 2-token request's one gap is all hand-off and
  one step; a 16-token request spreads the hand-off over 15 gaps);
- ``token_ms``: per streamed token, on the host beside the tiers (the router's work, the stream's),
  told from ``step_ms`` by the time per token of one stream against that of ``_STREAMS`` at once;
- ``encoder_batch_ms``: of ``image_ms``, what keeps the encoder busy once per batch beyond its
  forward (its results handed on, exported and pushed in the worker's one interpreter), told by
  two image requests at once: the second waits for the first's batch (the tiers only);
- ``wake``: how much longer a request's first token takes when it finds the whole cluster idle since
  a while, text and with an image (a virtual host's processes start cold: caches, descheduled CPUs);
- ``router``, ``background``, ``client``: the CPU spent beyond all of the above, per request, per
  image and per streamed token, from the processes' own counters (Linux), at two loads (``points``):
  paced streams (each request sent a lone request's duration after the one before, whether or not
  it finished: about one in flight) and ``_STREAMS`` requests at once (text with two output lengths,
  and with an image, each way): the more requests overlap, the more of a step's message and of a
  process's wake-ups they share. The router process's
  (its one event loop: HTTP, the body, detokenization, SSE; requests wait for it), the other
  processes' (their gRPC and IO threads, serialization, image decoding, health checks: host work
  beside the requests, taking cores from whatever runs) and the client's (charged where the client
  shares the host, as a benchmark's does). On a small host under load this is what slows every
  stage down.
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

from epd.bench.local_server import LocalServer, banner_processes
from epd.bench.pipeline_client import OUTPUT_TOKENS as _OUTPUT_TOKENS
from epd.bench.pipeline_client import PipelineClient
from epd.plan.costs import ENGINE_CROWD, engine_scale

_REQUESTS = 12
_IDLE_GAPS_S = (0.1, 0.5, 2.0)
_WAKE_REQUESTS = 4
_STREAMS = ENGINE_CROWD  # requests at once (the engine's crowded steps are read at it)
_CROWD_ROUNDS = 3  # rounds of _STREAMS requests at once
_PACED_REQUESTS = 32  # requests of each paced stream (text, short text, with an image)
_SHORT_TOKENS = 2  # a second output length: tells the CPU per request from the CPU per token
_PAIRS = 4  # pairs of image requests sent at once
_PAIR_IDLE_S = 0.3  # before each pair of image requests sent at once
_IDLE_S = 2.0  # how long the idle cluster's own CPU is counted (subtracted from every figure)


def _after_idle(client: PipelineClient, gap_s: float, picture) -> tuple[float, float]:
    """Median TTFT (text, image) of requests each sent after the cluster idled ``gap_s``."""
    text, image = [], []
    for _ in range(_WAKE_REQUESTS):
        time.sleep(gap_s)
        text.append(client.one(None)[0])
        time.sleep(gap_s)
        image.append(client.one(next(picture))[0])
    return statistics.median(text), statistics.median(image)


def _image_pair_gap_ms(client: PipelineClient, pairs: list[list[bytes]]) -> float:
    """The median time between the first tokens of two image requests sent at once to a cluster
    idle a little while (the second's image waits for the first's batch); ``pairs``: the images,
    made before (a client's own work, not a request's)."""
    gaps = []
    for pair in pairs:
        time.sleep(_PAIR_IDLE_S)
        first, second = sorted(ttft for ttft, _, _ in client.at_once(2, pair))
        gaps.append(second - first)
    return statistics.median(gaps)


def _concurrent_ms_per_token(client: PipelineClient) -> float:
    """The median time per output token of ``_STREAMS`` text requests sent at once (``_CROWD_ROUNDS`` rounds)."""
    per_token = []
    for _ in range(_CROWD_ROUNDS):
        per_token += [s for _, s, _ in client.at_once(_STREAMS)]
    return statistics.median(per_token)


_ROUTER = re.compile(r"(^|\s)(-m )?epd router(\s|$)")  # a router's command line, cold or forked


class CpuMeter:
    """CPU per request of a serving process tree (``pid`` and everything below it, less what it
    spends idle), of its router process, and of this process, the client: Linux's counters, None
    elsewhere."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.available = os.path.exists(f"/proc/{pid}/stat")
        self.idle_cores = (0.0, 0.0)  # the tree's and the router's

    def _now_s(self) -> tuple[float, float]:
        """CPU seconds so far: (the whole tree, its router processes)."""
        from epd.server.parent import command_line, cpu_seconds, descendants
        tree = {self.pid} | descendants(self.pid)
        return cpu_seconds(tree), cpu_seconds(p for p in tree if _ROUTER.search(command_line(p)))

    def measure_idle(self) -> None:
        if self.available:
            before = self._now_s()
            time.sleep(_IDLE_S)
            self.idle_cores = tuple((after - was) / _IDLE_S for after, was in zip(self._now_s(), before))

    def per_request(self, send, n: int) -> tuple[float, float, float] | None:
        """Run ``send()`` ``n`` times -> CPU ms per request of (the tree, the client, the router)."""
        if not self.available:
            for _ in range(n):
                send()
            return None
        before, client, wall = self._now_s(), time.process_time(), time.perf_counter()
        for _ in range(n):
            send()
        elapsed = time.perf_counter() - wall
        tree_s, router_s = (max(after - was - idle * elapsed, 0.0)
                            for after, was, idle in zip(self._now_s(), before, self.idle_cores))
        return 1000 * tree_s / n, 1000 * (time.process_time() - client) / n, 1000 * router_s / n


@dataclass
class Measured:
    """What one serving path showed, one request at a time (ms)."""

    ttft_text: float
    ttft_image: float
    tokens_text: int  # prompt tokens of the text request
    tokens_image: int  # and of the one with an image
    per_token: float  # time per output token of one stream
    per_token_crowded: float  # of each of _STREAMS streams at once
    after_idle: dict  # idle seconds -> (TTFT text, TTFT image) after idling that long
    # (cluster CPU ms, client CPU ms, the router's of the cluster's) per request: "text"
    # (_OUTPUT_TOKENS), "short" (_SHORT_TOKENS), "image" (_OUTPUT_TOKENS, one image), and where
    # measured, of paced streams: "paced", "paced_short" and "paced_image" (those, _PACED_REQUESTS
    # each), and of requests at once: "crowded", "crowded_short", "crowded_image" (those, _STREAMS at
    # once); None where the host has no CPU counters
    cpu: dict | None = None
    # each paced stream's mean decode batch (``PipelineClient.paced``); 1 where not given
    paced_batch: dict | None = None
    engine_in_router: bool = False  # --aggregated: the router's process runs every stage too
    # time per output token of text requests alone, with _OUTPUT_TOKENS and with _SHORT_TOKENS: they
    # tell the once-a-request hand-off from the per-step cost (None: per_token is taken as per step)
    per_token_text: float | None = None
    per_token_short: float | None = None
    # the first tokens of two image requests sent at once, the second's after the first's (None: unmeasured)
    image_pair_gap: float | None = None
    # the decode engine's own ms a step while the text requests ran one at a time, and while
    # _STREAMS ran at once, from its counters in the same run (None: unread; the profile's then)
    engine_step_alone: float | None = None
    engine_step_crowded: float | None = None


def _charged_ms(costs, derived: dict, tokens: int, output_tokens: int, image_px: int = 0, batch: float = 1,
                step_scale: float = 1.0, encoder_batch: float = 1) -> float:
    """The host CPU a simulator already charges a request: the router's work, the encoder (its share
    of a batch of ``encoder_batch``), the prefill, and its share of each decode step (the profile's at
    ``batch``, times ``step_scale``: how a decode worker's engine stepped in the run) with the serving
    path's per step and per token work."""
    steps = output_tokens - 1
    context = tokens + output_tokens / 2
    encoder = (costs.encoder_ms(image_px ** 2, encoder_batch) + derived.get("encoder_batch_ms", 0.0) / encoder_batch
               if image_px else 0.0)
    step_ms = costs.decode_ms(batch, context, sampled=True) * step_scale
    return (_router_charged_ms(costs, derived, output_tokens, image_px) + costs.prefill_ms(tokens) + encoder
            + steps * (step_ms + derived["step_ms"]) / batch)


def _router_charged_ms(costs, derived: dict, output_tokens: int, image_px: int = 0) -> float:
    """The router's share of ``_charged_ms``: its work before dispatch and per streamed token."""
    return costs.router_ms(image_px ** 2 if image_px else 0, 0.0) + output_tokens * derived["token_ms"]


def _background(costs, m: Measured, derived: dict, image_px: int) -> dict | None:
    """What the processes spent beyond what is charged, split per request, per image and per token
    (by the two output lengths): the router's (its one loop: work that requests wait for), the
    other processes' (``background``: work beside them), the client's. Never below zero."""
    if not m.cpu:
        return None
    long_n, short_n = _OUTPUT_TOKENS, _SHORT_TOKENS
    shapes = {"text": (m.tokens_text, long_n, 0), "short": (m.tokens_text, short_n, 0),
              "image": (m.tokens_image, long_n, image_px)}
    router, unseen = {}, {}
    for kind, (tree_ms, _, router_ms) in m.cpu.items():
        load, _, shape = kind.partition("_")  # "paced_short": a paced stream of short text requests
        if load not in ("paced", "crowded"):
            load, shape = "", kind
        tokens, n, px = shapes[shape or "text"]
        # the decode batch: a paced stream's as it ran (its images one at a time), a crowd's all of it
        batch = _STREAMS if load == "crowded" else (m.paced_batch or {}).get(kind, 1.0)
        scale = 1.0 if m.engine_in_router else engine_scale(costs, batch, True, m.engine_step_alone,
                                                             m.engine_step_crowded)
        everything = _charged_ms(costs, derived, tokens, n, px, batch, scale,
                                 encoder_batch=_STREAMS if load == "crowded" else 1)
        if m.engine_in_router:  # one process: what is beyond its stages runs beside its steps (torch's
            router[kind], unseen[kind] = 0.0, max(tree_ms - everything, 0.0)  # kernels let go of the lock)
            continue
        on_router = _router_charged_ms(costs, derived, n, px)
        # each process group's own never below zero (stage costs measured a little high must not
        # make the differences below large)
        router[kind] = max(router_ms - on_router, 0.0)
        unseen[kind] = max(tree_ms - router_ms - (everything - on_router), 0.0)
    client = {kind: values[1] for kind, values in m.cpu.items()}

    def one_load(values: dict, load: str) -> dict:
        """Per request, image and token, from ``load``'s text requests of two lengths and image ones."""
        text, short, image = values[load], values[f"{load}_short"], values[f"{load}_image"]
        token_ms = max((text - short) / (long_n - short_n), 0.0)
        request_ms = max(short - short_n * token_ms, 0.0)
        return {"request_ms": round(request_ms, 3), "token_ms": round(token_ms, 3),
                "image_ms": round(max(image - request_ms - long_n * token_ms, 0.0), 3)}

    in_flight = statistics.fmean((m.paced_batch or {}).values()) if m.paced_batch else 1.0

    def split(values: dict) -> dict:
        if not {"paced", "paced_short", "paced_image"} <= values.keys():  # one request at a time only
            token_ms = max((values["text"] - values["short"]) / (long_n - short_n), 0.0)
            return {"request_ms": round(max(values["short"] - short_n * token_ms, 0.0), 3),
                    "image_ms": round(max(values["image"] - values["text"], 0.0), 3), "token_ms": round(token_ms, 3)}
        # a paced stream, as under load: each request arrives while the one before may still run,
        # so its processes stay awake between events (one request alone, after the one before
        # ended, pays a step's message and the wake-ups again for every token: 5 to 10 times the CPU
        # a token here, which the profile's wake figures cover); requests at once share them too
        points = [{"in_flight": round(in_flight, 2), **one_load(values, "paced")}]
        if {"crowded", "crowded_short", "crowded_image"} <= values.keys():
            points.append({"in_flight": _STREAMS, **one_load(values, "crowded")})
        return {**{k: v for k, v in points[0].items() if k != "in_flight"}, "points": points}
    return {"router": split(router), "background": split(unseen), "client": split(client),
            "cpu_measured": {kind: [round(v, 2) for v in values] for kind, values in m.cpu.items()},
            **({"paced_batch": {kind: round(b, 2) for kind, b in m.paced_batch.items()}} if m.paced_batch else {})}


def _handoff_ms(m: Measured) -> tuple[float | None, float]:
    """(The hand-off, once a request, or None unmeasured; its share of each gap of a request of
    _OUTPUT_TOKENS). A request of n tokens has n - 1 gaps: the first is the hand-off and one step,
    each other one step, so its time per token is ``step + handoff / (n - 1)``; two lengths solve it."""
    if m.per_token_text is None or m.per_token_short is None:
        return None, 0.0
    long_gaps, short_gaps = _OUTPUT_TOKENS - 1, _SHORT_TOKENS - 1
    handoff = max((m.per_token_short - m.per_token_text) / (1 / short_gaps - 1 / long_gaps), 0.0)
    return handoff, handoff / long_gaps


def derive(costs, m: Measured, image_px: int) -> dict:
    """The path's own costs: what was measured less what the profile's stages account for."""
    request_ms = m.ttft_text - costs.prefill_ms(m.tokens_text) - costs.router_ms(0, 0.0)
    image_ms = (m.ttft_image - m.ttft_text - costs.encoder_ms(image_px ** 2, 1)
                - (costs.prefill_ms(m.tokens_image) - costs.prefill_ms(m.tokens_text)))
    context = m.tokens_text + _OUTPUT_TOKENS / 2
    handoff_ms, per_gap = _handoff_ms(m)
    # one step, one token (text requests' time per token less their hand-off's share where it was
    # told apart): the path's per step and per token; _STREAMS text streams: one step, _STREAMS tokens
    # the engine's steps as timed in this run where it was read: what is left is the path's own,
    # not the drift of this host between the profile's steps and these requests
    one_stream = m.per_token if handoff_ms is None else m.per_token_text - per_gap
    step_alone, step_crowded = m.engine_step_alone, m.engine_step_crowded
    if step_alone is None:
        step_alone = costs.decode_ms(1, context, sampled=True)
    if step_crowded is None:
        step_crowded = costs.decode_ms(_STREAMS, context, sampled=True)
    alone = one_stream - step_alone
    crowded = m.per_token_crowded - per_gap - step_crowded
    token_ms = max((crowded - alone) / (_STREAMS - 1), 0.0)
    derived = {"step_ms": round(max(alone - token_ms, 0.0), 3), "token_ms": round(token_ms, 3)}
    if handoff_ms is not None and not m.engine_in_router:  # beyond the KV transfer the simulator charges
        kv_bytes = m.tokens_text * (costs.shapes or {}).get("kv_bytes_per_token", 0)
        derived["handoff_ms"] = round(max(handoff_ms - costs.transfer_ms(costs.local_transport, kv_bytes), 0.0), 3)
    if m.image_pair_gap is not None and not m.engine_in_router:
        # the second image waits for the first's forward and for what the encoder does after it;
        # that part of the image's path is the encoder's work, the rest a delay beside it
        after_forward = m.image_pair_gap - costs.encoder_ms(image_px ** 2, 1)
        derived["encoder_batch_ms"] = round(min(max(after_forward, 0.0), max(image_ms, 0.0)), 3)
    cpu = _background(costs, m, derived, image_px) or {}
    # what a simulator charges on the way besides the stages is not a delay as well: the router's
    # work beyond its costs (its loop does it before dispatch) and the image rows' transfer
    router = cpu.get("router", {})
    rows_bytes = max(m.tokens_image - m.tokens_text, 0) * (costs.shapes or {}).get("row_bytes", 0)
    request_ms -= router.get("request_ms", 0.0)
    image_ms -= router.get("image_ms", 0.0) + (costs.transfer_ms(costs.local_transport, rows_bytes)
                                               if rows_bytes and not m.engine_in_router else 0.0)
    if "encoder_batch_ms" in derived:  # the encoder's part of what is left of the image's way
        derived["encoder_batch_ms"] = min(derived["encoder_batch_ms"], round(max(image_ms, 0.0), 3))
    return {"request_ms": round(max(request_ms, 0.0), 3), "image_ms": round(max(image_ms, 0.0), 3), **derived, **cpu,
            "wake": [{"idle_s": gap, "text_ms": round(max(t - m.ttft_text, 0.0), 3),
                      "image_ms": round(max(i - m.ttft_image, 0.0), 3)} for gap, (t, i) in m.after_idle.items()],
            "measured": {"ttft_text_ms": round(m.ttft_text, 2), "ttft_image_ms": round(m.ttft_image, 2),
                         "ms_per_token": round(m.per_token, 3),
                         **({"ms_per_token_text": round(m.per_token_text, 3),
                             f"ms_per_token_{_SHORT_TOKENS}_tokens": round(m.per_token_short, 3)}
                            if m.per_token_text is not None and m.per_token_short is not None else {}),
                         f"ms_per_token_{_STREAMS}_streams": round(m.per_token_crowded, 3),
                         **({"engine_ms_per_step": round(m.engine_step_alone, 3)}
                            if m.engine_step_alone is not None else {}),
                         **({f"engine_ms_per_step_{_STREAMS}_streams": round(m.engine_step_crowded, 3)}
                            if m.engine_step_crowded is not None else {}),
                         "prompt_tokens": [m.tokens_text, m.tokens_image],
                         **({"image_pair_gap_ms": round(m.image_pair_gap, 2)} if m.image_pair_gap is not None else {})}}


class EngineMeter:
    """The decode engine's time per step over a stretch of requests, from its worker's counters
    (``epd_engine_step_seconds``, ``epd_engine_steps``); every reading None without the worker's
    metrics address."""

    def __init__(self, metrics_url: str | None) -> None:
        self.url = metrics_url

    def _now(self) -> tuple[float, float] | None:
        import urllib.request

        from epd.bench.metrics import metric_sum, parse_prometheus
        if self.url is None:
            return None
        try:
            with urllib.request.urlopen(self.url, timeout=10) as resp:
                parsed = parse_prometheus(resp.read().decode())
        except OSError:  # unreachable: the profile's step stands in (the JSON's "measured" shows which)
            return None
        seconds, steps = (metric_sum(parsed, name) for name in ("epd_engine_step_seconds_total", "epd_engine_steps_total"))
        return None if seconds is None or steps is None else (seconds, steps)

    def ms_per_step(self, run) -> float | None:
        """``run()``, and the engine's ms per step while it ran (None: unread, or no step)."""
        before = self._now()
        run()
        after = self._now()
        if before is None or after is None or after[1] <= before[1]:
            return None
        return 1000 * (after[0] - before[0]) / (after[1] - before[1])


def decode_metrics_url(lines: list[str]) -> str | None:
    """The first decode worker's metrics address in ``epd serve``'s ready lines (None: none given)."""
    return next((p.metrics_url for p in banner_processes(lines) if p.tier == "decode" and p.metrics_url), None)


def _measure_path(pid: int, client: PipelineClient, picture, engine: EngineMeter) -> tuple:
    """One serving path's figures: (text runs, image runs, short text runs, CPU per request, each
    paced stream's mean decode batch, TTFTs after idling, ms per token of _STREAMS streams at once,
    the gap between two images at once, the engine's ms a step alone and crowded)."""
    for _ in range(2):  # warm: the first requests of a process pay for what it loads lazily
        client.one(None)
        client.one(next(picture))
    meter = CpuMeter(pid)
    meter.measure_idle()
    text, image, short, cpu = [], [], [], {}
    steps = {}
    steps["alone"] = engine.ms_per_step(
        lambda: cpu.update(text=meter.per_request(lambda: text.append(client.one(None)), _REQUESTS)))
    pictures = iter([next(picture) for _ in range(_REQUESTS)])  # made before: a client's own work
    cpu["image"] = meter.per_request(lambda: image.append(client.one(next(pictures))), _REQUESTS)
    cpu["short"] = meter.per_request(lambda: short.append(client.one(None, _SHORT_TOKENS)), _REQUESTS)
    after_idle = {gap: _after_idle(client, gap, picture) for gap in _IDLE_GAPS_S}
    crowded = []
    crowd = lambda: crowded.append(_concurrent_ms_per_token(client))  # noqa: E731
    steps["crowded"] = engine.ms_per_step(lambda: cpu.update(crowded=meter.per_request(crowd, 1)))
    # the same requests at once with _SHORT_TOKENS each, and with an image each: the CPU per request,
    # per image and per token of requests that overlap (their processes awake, their events shared)
    crowd_short = lambda: [client.at_once(_STREAMS, max_tokens=_SHORT_TOKENS) for _ in range(_CROWD_ROUNDS)]  # noqa: E731
    cpu["crowded_short"] = meter.per_request(crowd_short, 1)
    images = [next(picture) for _ in range(_CROWD_ROUNDS * _STREAMS)]  # made before: a client's own work
    crowd_images = lambda: [client.at_once(_STREAMS, images[k::_CROWD_ROUNDS]) for k in range(_CROWD_ROUNDS)]  # noqa: E731
    cpu["crowded_image"] = meter.per_request(crowd_images, 1)
    for kind in ("crowded", "crowded_short", "crowded_image"):
        if cpu[kind] is not None:  # per request
            cpu[kind] = tuple(ms / (_CROWD_ROUNDS * _STREAMS) for ms in cpu[kind])
    # the CPU per request, per image and per token under load: paced streams, a request each lone
    # image request's duration (about one in flight, arriving while the one before may still run)
    interval_s = statistics.median(ttft + (_OUTPUT_TOKENS - 1) * tpot for ttft, tpot, _ in image) / 1000
    batch = {}
    images = [next(picture) for _ in range(_PACED_REQUESTS)]  # made before: a client's own work
    for kind, stream in (("paced", lambda: client.paced(_PACED_REQUESTS, interval_s)),
                         ("paced_short", lambda: client.paced(_PACED_REQUESTS, interval_s, max_tokens=_SHORT_TOKENS)),
                         ("paced_image", lambda: client.paced(_PACED_REQUESTS, interval_s, images))):
        cpu[kind] = meter.per_request(lambda s=stream, k=kind: batch.__setitem__(k, s()), 1)
        if cpu[kind] is not None:  # per request
            cpu[kind] = tuple(ms / _PACED_REQUESTS for ms in cpu[kind])
    pairs = [[next(picture), next(picture)] for _ in range(_PAIRS)]
    return text, image, short, cpu, batch, after_idle, crowded[0], _image_pair_gap_ms(client, pairs), steps


PATHS = {"epd": (), "aggregated": ("--aggregated",)}  # a serving path -> epd serve's flags for it


def measure(model: str, costs, image_px: int = 448, paths: tuple[str, ...] = tuple(PATHS)) -> dict:
    """{"epd": {...}, "aggregated": {...}}: each path's ``request_ms``, ``image_ms``, ``step_ms``;
    ``costs``: this profile's ``epd.plan.costs.StageCosts`` (what the stages account for);
    ``paths``: which of ``PATHS`` to measure."""
    from epd.bench.workload import ImageSpec, render_image

    out = {}
    for name in paths:
        flags = PATHS[name]
        picture = iter(render_image(ImageSpec(image_px, image_px, seed)) for seed in range(1 << 20))
        command = [sys.executable, "-m", "epd", "serve", "--model", model, "--port", "0", "--grpc-port", "0",
                   "--no-standby", *flags]
        with LocalServer(command, name=f"epd serve {' '.join(flags)}") as serve:
            client = PipelineClient(serve.url, model)
            try:
                engine = EngineMeter(None if flags else decode_metrics_url(serve.lines))
                text, image, short, cpu, batch, after_idle, crowded_ms, pair_gap_ms, steps = _measure_path(
                    serve.proc.pid, client, picture, engine)
            finally:
                client.close()
        ttft_text, ttft_image = (statistics.median(t for t, _, _ in runs) for runs in (text, image))
        out[name] = derive(costs, Measured(ttft_text, ttft_image, text[-1][2], image[-1][2],
                                           statistics.median(s for _, s, _ in text + image), crowded_ms,
                                           after_idle, cpu if None not in cpu.values() else None,
                                           engine_in_router=bool(flags),
                                           per_token_text=statistics.median(s for _, s, _ in text),
                                           per_token_short=statistics.median(s for _, s, _ in short),
                                           image_pair_gap=pair_gap_ms, engine_step_alone=steps["alone"],
                                           engine_step_crowded=steps["crowded"], paced_batch=batch), image_px)
    return out
