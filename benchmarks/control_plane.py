"""The control plane's cost: N concurrent streams x T tokens through ``epd serve``, and what each
process spends per token, with the model's own cost taken out (the zero-cost ``null-qwen2-vl``)
and kept in (``tiny-qwen2-vl``).

For each model and each topology (one decode worker, two, ``--aggregated``, ``1d-grpc``: one decode
worker streaming over its gRPC call instead of the TCP link, the link's baseline, and ``2d-2r``: two
decode workers and two routers on the one port), in one run: text-
only and one-image chats at each concurrency. Printed per point: tokens/s through the router; CPU
ms per streamed token of the router, of each tier, and of the client; decode CPU ms per engine step
at the mean batch of the load (tokens over steps), and in parentheses over the periods in which every
decode worker ran its whole share of the streams (``FullBatchProbe``: the batch a GPU worker would
hold; the mean counts the ramp and the tail). CPU is utime + stime from /proc, every
thread of the process, measured over the load alone.

``--collector``: also the garbage collector's CPU per streamed token in each process (every EPD
process started with ``benchmarks/collector_probe`` on its path, which counts each collection's CPU).

A model ``null-qwen2-vl@N`` is the zero-cost model whose every forward takes N ms asleep: steps
paced as a GPU's are (10-100 ms at a large batch), the host idle in between as it is beside a GPU,
with no model computing on the cores the router shares.

The client is light and not the bottleneck: raw asyncio sockets (HTTP/1.1, one connection per
stream), SSE counted by lines, only the last event (usage) parsed, spread over several processes;
its own CPU is printed beside the rest.

    python benchmarks/control_plane.py [--models null-qwen2-vl,null-qwen2-vl@80,tiny-qwen2-vl] [--streams 64,256]
        [--tokens 256] [--topologies 1d,2d,aggregated,1d-grpc,2d-2r] [--kinds text,image] [--out cp.json] [--api-key K]
        [--collector] [--temperature T] [--stream-intervals 1,4]

Only loopback; every process started is stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common import BENCH_DIR, Server, noise_png  # noqa: F401  (also puts the checkout on sys.path)

from epd.bench.local_server import banner_processes  # noqa: E402
from epd.server.parent import cpu_seconds  # noqa: E402

_TOPOLOGIES = {"1d": ("epd", ()), "2d": ("epd", ("--decodes", "2")), "aggregated": ("aggregated", ()),
               # decode's tokens over its gRPC Stream call instead of the TCP link: the link's baseline
               "1d-grpc": ("epd", ("--decode-link", "grpc")),
               # two routers on the one HTTP port (--routers 2): how the router tier scales out
               "2d-2r": ("epd", ("--decodes", "2", "--routers", "2"))}
_AUTH = {"header": b""}  # with --api-key: every request's Authorization line (the client processes fork)


def served_model(label: str, scratch: Path) -> str:
    """What ``epd serve --model`` takes for a label: ``null-qwen2-vl@80`` is that zero-cost preset
    with ``step_ms`` 80, written once under ``scratch``; any other label as it is."""
    name, _, step_ms = label.partition("@")
    if not step_ms:
        return label
    from epd.models.null.checkpoint import NULL_PRESETS, write_null_checkpoint
    if name not in NULL_PRESETS:
        raise SystemExit(f"--models {label}: only a zero-cost preset ({', '.join(NULL_PRESETS)}) can be paced")
    return str(write_null_checkpoint(scratch / label, replace(NULL_PRESETS[name], step_ms=float(step_ms))))


def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token, at fp32 (the CPU's dtype), from the checkpoint's config."""
    from epd.models.locate import resolve_model
    with open(os.path.join(resolve_model(model), "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim * 4


# ---- the client --------------------------------------------------------------------------------
_SAMPLING: dict = {}  # with --temperature: every request's (else the API's default, 1)


def _body(model: str, tokens: int, image_seed: int | None) -> bytes:
    content: list | str = "Tell me a long story."
    if image_seed is not None:
        url = "data:image/png;base64," + base64.b64encode(noise_png(224, image_seed)).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       **_SAMPLING}).encode()


async def _stream(host: str, port: int, body: bytes) -> tuple[int, int]:
    """One streamed chat on its own connection -> (completion tokens from the usage event, events)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 + _AUTH["header"] + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        rest = await reader.read(2000)
        raise RuntimeError(f"{status!r} {rest[-500:]!r}")
    events, last = 0, b""
    async for line in reader:  # the chunked framing's size lines are not "data:" lines
        if line.startswith(b"data: {"):
            events, last = events + 1, line
    writer.close()
    usage = json.loads(last[6:]).get("usage") or {}
    return usage.get("completion_tokens", 0), events


def _client_process(url: str, bodies: list[bytes], out) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def main():
        return await asyncio.gather(*(_stream(host, int(port), b) for b in bodies), return_exceptions=True)

    started = time.process_time()
    results = asyncio.run(main())
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    out.put({"tokens": sum(t for t, _ in ok), "events": sum(e for _, e in ok), "errors": errors[:3],
             "num_errors": len(errors), "cpu_s": time.process_time() - started})


def run_load(url: str, bodies: list[bytes], num_procs: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(url, bodies[i::num_procs], out)) for i in range(num_procs)]
    for p in procs:
        p.start()
    parts = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    return {key: sum(p[key] for p in parts) if key != "errors" else [e for p in parts for e in p[key]]
            for key in parts[0]}


# ---- one point ---------------------------------------------------------------------------------
@dataclass
class Point:
    model: str
    topology: str
    kind: str
    streams: int
    tokens_per_stream: int
    tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    events_per_token: float = 0.0
    cpu_ms_per_token: dict = field(default_factory=dict)  # process -> CPU ms per streamed token
    collector_ms_per_token: dict = field(default_factory=dict)  # with --collector: process -> its GC's CPU
    decode_ms_per_step: float | None = None
    decode_batch: float | None = None
    full_batch_ms_per_step: float | None = None  # decode CPU per step while every worker ran its whole share
    full_batch_s: float = 0.0  # the seconds that figure is over
    errors: list = field(default_factory=list)


class Cluster:
    """A started ``epd serve`` and its processes' pids (from its banner)."""

    def __init__(self, model: str, topology: str, api_key: str = "", max_batch: int = 64,
                 tokens_per_stream: int = 256, stream_interval: int = 1) -> None:
        system, extra = _TOPOLOGIES[topology]
        if stream_interval != 1:
            extra = (*extra, "--stream-interval", str(stream_interval))
        auth = ("--api-key", api_key) if api_key else ()
        # every stream decoding at once: a batch of the largest concurrency, and the KV it needs (a
        # decode worker reserves each request's whole budget: a smaller cache would cap the batch)
        self.model = model  # what clients send as "model": the served name
        kv_bytes = max(256 << 20, max_batch * (tokens_per_stream + 64) * kv_bytes_per_token(model))
        batch = ("--max-num-seqs", str(max_batch), "--kv-cache-bytes", str(kv_bytes))
        self.server = Server(system, model, "--no-standby", "--max-concurrent-requests", "1024", *extra, *auth,
                             *batch)

    def __enter__(self) -> "Cluster":
        self.server.__enter__()
        deadline = time.monotonic() + 60
        while not any("Ctrl-C stops everything" in line for line in self.server.lines):
            if time.monotonic() > deadline:
                raise RuntimeError("no banner:\n" + "\n".join(self.server.lines[-20:]))
            time.sleep(0.1)
        self.pids: dict[str, int] = {}
        self.decode_metrics: list[str] = []
        counts: dict[str, int] = {}
        for p in banner_processes(self.server.lines):
            counts[p.tier] = counts.get(p.tier, 0) + 1
            n = counts[p.tier] - 1  # routers: router, router1, ...; workers: decode0, decode1, ...
            self.pids[f"{p.tier}{n}" if p.tier != "router" else f"router{n or ''}"] = p.pid
            if p.tier == "decode" and p.metrics_url:
                self.decode_metrics.append(p.metrics_url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def decode_steps(self) -> float:
        return sum(steps for steps, _ in self.decode_counts())

    def decode_counts(self) -> list[tuple[float, float]]:
        """Each decode worker's (engine steps so far, requests running now), from its metrics."""
        counts = []
        for url in self.decode_metrics:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            steps = sum(float(v) for v in re.findall(r"^epd_engine_steps_total\{[^}]*\} (\S+)$", text, re.M))
            running = re.search(r"^epd_running_requests\{?[^}\n]*\}? (\S+)$", text, re.M)
            counts.append((steps, float(running.group(1)) if running else 0.0))
        return counts


class FullBatchProbe:
    """Decode CPU per step while every worker runs its whole share of the streams: the mean over a
    load counts the ramp (requests arriving) and the tail (streams ending) at smaller batches, and
    the issue's figure is a step at the full batch. Every ``period_s`` it reads the decode workers'
    CPU, steps and running requests; a period counts when each worker ran at least ``full`` requests
    at both of its ends. Reading the metrics costs the worker a scrape per period (~1 ms)."""

    def __init__(self, cluster: "Cluster", full: int, period_s: float = 0.5) -> None:
        self.cluster, self.full, self.period_s = cluster, full, period_s
        self.samples: list[tuple[float, float, bool]] = []  # (decode CPU s, steps, all at full batch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FullBatchProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        pids = [pid for name, pid in self.cluster.pids.items() if name.startswith("decode")]
        while not self._stop.wait(self.period_s):
            counts = self.cluster.decode_counts()
            self.samples.append((cpu_seconds(pids), sum(s for s, _ in counts),
                                 all(running >= self.full for _, running in counts)))

    def ms_per_step(self) -> tuple[float, float] | None:
        """-> (decode CPU ms per step over the full-batch periods, seconds of them), None without any."""
        cpu_s = steps = seconds = 0.0
        for (cpu0, steps0, full0), (cpu1, steps1, full1) in zip(self.samples, self.samples[1:]):
            if full0 and full1 and steps1 > steps0:
                cpu_s, steps, seconds = cpu_s + cpu1 - cpu0, steps + steps1 - steps0, seconds + self.period_s
        return (1000 * cpu_s / steps, seconds) if steps else None


_COLLECTOR = {"dir": None}  # with --collector: where each server process writes its collector's totals


def collector_cpu_s(pid: int) -> float:
    """The garbage collector's CPU seconds so far in process ``pid`` (0 before its first report)."""
    try:
        with open(os.path.join(_COLLECTOR["dir"], f"{pid}.json")) as f:
            return sum(json.load(f)["cpu_s"])
    except (OSError, ValueError):
        return 0.0


def measure(cluster: Cluster, point: Point, num_client_procs: int) -> Point:
    collector = _COLLECTOR["dir"] is not None
    if collector:
        time.sleep(0.6)  # every process has reported what came before the load
        gc_before = {name: collector_cpu_s(pid) for name, pid in cluster.pids.items()}
    seeds = range(point.streams) if point.kind == "image" else [None] * point.streams
    bodies = [_body(cluster.model, point.tokens_per_stream, None if s is None else 1000 * point.streams + s)
              for s in seeds]
    before = {name: cpu_seconds([pid]) for name, pid in cluster.pids.items()}
    steps_before = cluster.decode_steps() if cluster.decode_metrics else 0.0
    start = time.monotonic()
    with FullBatchProbe(cluster, point.streams // max(1, len(cluster.decode_metrics))) as probe:
        result = run_load(cluster.server.url, bodies, num_client_procs)
    point.wall_s = time.monotonic() - start
    after = {name: cpu_seconds([pid]) for name, pid in cluster.pids.items()}
    point.tokens, point.errors = result["tokens"], result["errors"]
    point.tokens_per_s = point.tokens / point.wall_s
    point.events_per_token = result["events"] / max(1, point.tokens)
    per_token = 1000.0 / max(1, point.tokens)
    point.cpu_ms_per_token = {name: round((after[name] - before[name]) * per_token, 4) for name in before}
    point.cpu_ms_per_token["client"] = round(result["cpu_s"] * per_token, 4)
    if collector:
        time.sleep(0.6)
        point.collector_ms_per_token = {name: round((collector_cpu_s(pid) - gc_before[name]) * per_token, 5)
                                        for name, pid in cluster.pids.items()}
    if cluster.decode_metrics:
        steps = cluster.decode_steps() - steps_before
        decode_cpu_s = sum(after[n] - before[n] for n in before if n.startswith("decode"))
        point.decode_ms_per_step = round(1000 * decode_cpu_s / max(1.0, steps), 3)
        point.decode_batch = round(point.tokens / max(1.0, steps), 1)
        if (full := probe.ms_per_step()) is not None:
            point.full_batch_ms_per_step, point.full_batch_s = round(full[0], 3), full[1]
    return point


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="null-qwen2-vl,tiny-qwen2-vl")
    parser.add_argument("--topologies", default="1d,2d,aggregated")
    parser.add_argument("--kinds", default="text,image")
    parser.add_argument("--streams", default="1,64,256", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--out", default="", help="write every point as JSON here too")
    parser.add_argument("--collector", action="store_true",
                        help="also the garbage collector's CPU per token in each process")
    parser.add_argument("--api-key", default="", help="serve with this API key (the key check's cost included)")
    parser.add_argument("--stream-intervals", default="1",
                        help="serve with each --stream-interval (tokens a group after the first), comma-separated: "
                             "a topology run once per value, labelled topology/N")
    parser.add_argument("--temperature", type=float, default=None,
                        help="every request's (default: unset, the API's 1; 0: greedy, no softmax and draw over "
                             "the logits, the arithmetic a GPU does for the host)")
    args = parser.parse_args()
    if args.temperature is not None:
        _SAMPLING["temperature"] = args.temperature
    if args.api_key:
        _AUTH["header"] = b"Authorization: Bearer " + args.api_key.encode() + b"\r\n"
    points = []
    header = f"{'model':<18}{'topology':<11}{'kind':<6}{'N':>5}{'tok/s':>8}{'ev/tok':>7}  CPU ms per token " \
             f"(router, tiers, client){'':>4}decode ms/step @batch"
    print(header, flush=True)
    scratch = tempfile.TemporaryDirectory(prefix="epd-control-plane-")
    if args.collector:  # inherited by epd serve and every process it starts
        _COLLECTOR["dir"] = os.path.join(scratch.name, "collector")
        os.makedirs(_COLLECTOR["dir"])
        os.environ["EPD_BENCH_COLLECTOR_DIR"] = _COLLECTOR["dir"]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR / "collector_probe"),
                                                                 os.environ.get("PYTHONPATH")) if p)
    runs = [(topology, int(interval)) for topology in args.topologies.split(",")
            for interval in args.stream_intervals.split(",")]
    for model in args.models.split(","):
        for topology, interval in runs:
            label = topology if interval == 1 else f"{topology}/{interval}"
            with Cluster(served_model(model, Path(scratch.name)), topology, args.api_key,
                         max(int(n) for n in args.streams.split(",")),
                         args.tokens, interval) as cluster:
                warm = Point(model, label, "text", 4, 16)
                measure(cluster, warm, 1)  # imports, first steps, connections
                for kind in args.kinds.split(","):
                    for streams in (int(n) for n in args.streams.split(",")):
                        point = measure(cluster, Point(model, label, kind, streams, args.tokens),
                                        args.client_procs)
                        points.append(point)
                        cpu = " ".join(f"{name}={ms:.3f}" for name, ms in point.cpu_ms_per_token.items())
                        decode = f"{point.decode_ms_per_step:.2f} @{point.decode_batch:.0f}" \
                            if point.decode_ms_per_step is not None else "-"
                        if point.full_batch_ms_per_step is not None:
                            decode += f" ({point.full_batch_ms_per_step:.2f} @{streams // len(cluster.decode_metrics)}" \
                                      f" full, {point.full_batch_s:.0f} s)"
                        print(f"{model:<18}{label:<11}{kind:<6}{streams:>5}{point.tokens_per_s:>8.0f}"
                              f"{point.events_per_token:>7.2f}  {cpu}  {decode}"
                              f"{'  ERRORS ' + str(point.errors) if point.errors else ''}", flush=True)
                        if point.collector_ms_per_token:
                            print(f"{'':<40}collector CPU ms per token: " + " ".join(
                                f"{name}={ms:.4f}" for name, ms in point.collector_ms_per_token.items()), flush=True)
    scratch.cleanup()
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(p) for p in points], f, indent=2)
    return 1 if any(p.errors for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
