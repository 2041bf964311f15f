"""Burst load: N concurrent streaming chat completions fired at once at ``epd serve`` (1E1P1D) and at
``epd serve --aggregated`` (the baseline, measured in the same run), one server at a time. Counts
successes, 5xx, 429s (retried after Retry-After, up to 3 times) and failures, the burst's wall time,
and whether any worker left rotation (router GET /health, sampled every 0.5 s); also the threads,
open fds and RSS of every process of the server before, at the peak of and after the burst.

    python benchmarks/burst.py [--n 64,128,256] [--modes epd,aggregated] [--max-tokens 16]
        [--model tiny-qwen2-vl] [--image-size 448] [--text-only] [--json PATH] [--serve-arg=--flag ...]

    python benchmarks/burst.py --text-only --n 1024 --max-tokens 16 --modes epd   # 1,024 text streams

Targets per N: 0 failed requests, 0 5xx, EPD wall <= 1.2x aggregated wall. Only loopback; every
process started is stopped (the ``epd serve`` tree, its children by pid), every wait is bounded.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import resource
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Self

import httpx
import openai
from common import Server, noise_png

TARGET_WALL_RATIO = 1.2
MAX_RETRIES_429 = 3
MAX_RETRY_WAIT_S = 60.0  # a Retry-After beyond this is capped: the burst must end in bounded time
SAMPLE_PERIOD_S = 0.5
HEALTH_PROBE_TIMEOUT_S = 2.0  # short, so a stuck router still leaves the sampling cadence near 0.5 s
AFTER_BURST_WAIT_S = 2.0
NUM_WARMUP_REQUESTS = 2  # every process pays first-call costs (allocator, thread pools) once
WARMUP_SEED_BASE = 10_000_000  # warm-up images never collide with a burst's
MAX_ERRORS_KEPT = 5


# ---- requests ------------------------------------------------------------------------------------------
def image_data_url(size_px: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(noise_png(size_px, seed)).decode("ascii")


def image_messages(data_url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                         {"type": "text", "text": "Describe the image."}]}]


def text_messages(i: int) -> list[dict]:
    # distinct per request, so no two share more than the chat template's prefix
    return [{"role": "user", "content": f"Request {i}: describe a quiet morning by the sea."}]


def build_conversations(n: int, first_seed: int, args: argparse.Namespace) -> list[list[dict]]:
    """N conversations; with images, each its own noise image (no encoder-cache hits)."""
    if args.text_only:
        return [text_messages(first_seed + i) for i in range(n)]
    return [image_messages(image_data_url(args.image_size, first_seed + i)) for i in range(n)]


@dataclass
class Outcome:
    """One request of a burst, over all its attempts."""
    ok: bool = False
    finish_reason: str | None = None
    num_429: int = 0
    failure: str | None = None  # "http_5xx", "http_4xx", "429_after_retries", "stream_error", "connection", ...
    status: int | None = None  # HTTP status (or the error event's code) of the final failure
    message: str | None = None
    latency_s: float = 0.0  # from the first attempt to the end of the stream
    ttft_s: float | None = None  # from the first attempt to the first content token
    num_chunks: int = 0


def _retry_after_s(err: openai.APIStatusError) -> float | None:
    value = err.response.headers.get("retry-after")
    try:
        return min(MAX_RETRY_WAIT_S, max(0.0, float(value))) if value is not None else None
    except ValueError:
        return None


def _error_message(err: openai.APIError) -> str:
    body = err.body if isinstance(err.body, dict) else {}
    return str(body.get("message") or err.message)[:300]


async def _stream_once(client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int,
                       out: Outcome, start_s: float) -> None:
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
    async for chunk in stream:
        out.num_chunks += 1
        for choice in chunk.choices:
            if out.ttft_s is None and choice.delta.content:
                out.ttft_s = time.perf_counter() - start_s
            if choice.finish_reason:
                out.finish_reason = choice.finish_reason


async def one_request(client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int) -> Outcome:
    """One streaming chat; a 429 with Retry-After is retried after that long (up to 3 times)."""
    out, start_s = Outcome(), time.perf_counter()
    for attempt in range(MAX_RETRIES_429 + 1):
        try:
            await _stream_once(client, model, messages, max_tokens, out, start_s)
            out.ok = out.finish_reason is not None
            out.failure = None if out.ok else "no_finish_reason"
            if out.ok:  # an earlier attempt's 429 stays counted in num_429, not as this outcome's status
                out.status = out.message = None
            break
        except openai.APIStatusError as err:  # an HTTP error status before the stream started
            out.status, out.message = err.status_code, _error_message(err)
            if err.status_code == 429:
                out.num_429 += 1
                wait_s = _retry_after_s(err)
                if wait_s is not None and attempt < MAX_RETRIES_429:
                    await asyncio.sleep(wait_s)
                    continue
                out.failure = "429_after_retries" if wait_s is not None else "429_no_retry_after"
            else:
                out.failure = "http_5xx" if err.status_code >= 500 else "http_4xx"
            break
        except (openai.APIConnectionError, httpx.TransportError) as err:  # timeouts included
            out.failure, out.message = "connection", f"{type(err).__name__}: {err}"[:300]
            break
        except openai.APIError as err:  # an error event in the stream (status 200, the code in the body)
            code = err.body.get("code") if isinstance(err.body, dict) else None
            out.status = code if isinstance(code, int) else None
            out.failure, out.message = "stream_error", _error_message(err)
            break
    out.latency_s = time.perf_counter() - start_s
    return out


def make_client(url: str, max_connections: int, request_timeout_s: float) -> openai.AsyncOpenAI:
    # one pool wide enough for every stream at once, or the pool itself would queue the burst
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout_s, connect=30.0))
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=request_timeout_s,
                              http_client=http)


async def run_burst(url: str, model: str, conversations: list[list[dict]], args: argparse.Namespace
                    ) -> tuple[list[Outcome], float]:
    """All requests started at once; -> their outcomes and the wall time until the last one ended."""
    client = make_client(url, len(conversations) + 16, args.request_timeout_s)
    try:
        start_s = time.perf_counter()
        tasks = [asyncio.create_task(one_request(client, model, c, args.max_tokens)) for c in conversations]
        done, pending = await asyncio.wait(tasks, timeout=args.burst_timeout_s)
        for task in pending:  # past the burst's deadline: count as failures, do not wait on
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.perf_counter() - start_s
        outcomes = [t.result() if t in done and not t.exception() else
                    Outcome(failure="burst_timeout" if t in pending else "client_exception",
                            message=None if t in pending else repr(t.exception())[:300])
                    for t in tasks]
        return outcomes, wall_s
    finally:
        await client.close()


async def warm_up(url: str, model: str, args: argparse.Namespace) -> None:
    client = make_client(url, 4, args.request_timeout_s)
    try:
        for k in range(NUM_WARMUP_REQUESTS):
            conversation = build_conversations(1, WARMUP_SEED_BASE + k, args)[0]
            out = await one_request(client, model, conversation, args.max_tokens)
            if not out.ok:
                print(f"  warm-up request {k} failed: {out.failure} {out.status} {out.message}", flush=True)
    finally:
        await client.close()


# ---- the server's processes ------------------------------------------------------------------------------
def _proc_start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def _proc_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _proc_label(pid: int) -> str:
    """``python -m epd encoder ...`` -> "encoder"; anything else by its executable's name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if "-m" in argv and argv.index("-m") + 2 < len(argv) and argv[argv.index("-m") + 1] == "epd":
        return argv[argv.index("-m") + 2]
    return os.path.basename(argv[0]) if argv else "?"


def child_processes(parent_pid: int) -> dict[int, int | None]:
    """pid -> start time (clock ticks) of every direct child of ``parent_pid``; the start time tells
    a recycled pid from ours when stopping them."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and _proc_ppid(int(name)) == parent_pid:
            children[int(name)] = _proc_start_ticks(int(name))
    return children


class ServeTree(Server):
    """``common.Server`` that also knows the tier processes ``epd serve`` started (they run in their
    own sessions, so a kill of the serve process group would miss them) and stops any that outlived
    their parent, by pid."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.children: dict[int, int | None] = {}

    def __enter__(self) -> Self:
        super().__enter__()
        self.children = child_processes(self.proc.pid)
        return self

    def labelled_pids(self) -> dict[str, int]:
        """"router", "encoder", "prefill", "decode" (numbered when a tier has several) -> pid."""
        labels: dict[str, int] = {}
        for pid in sorted(self.children):
            base = _proc_label(pid)
            label = base if base not in labels else f"{base}-{sum(k.startswith(base) for k in labels)}"
            labels[label] = pid
        return labels

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            stop_leftovers(self.children)


def stop_leftovers(children: dict[int, int | None], timeout_s: float = 15.0) -> None:
    alive = {pid for pid, ticks in children.items() if ticks is not None and _proc_start_ticks(pid) == ticks}
    for pid in alive:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _proc_start_ticks(pid) == children[pid]}
        time.sleep(0.1)
    for pid in alive:
        print(f"  pid {pid} outlived epd serve and SIGTERM; killing it", flush=True)
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def process_stats(pid: int) -> dict | None:
    """Threads, open fds and resident bytes from /proc (psutil is not a dependency); None once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {"threads": int(fields["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024}
    except (OSError, KeyError, ValueError):
        return None


def fd_kinds(pid: int) -> dict[str, int]:
    """Open fds by what they point at (socket, pipe, /dev/shm, anon_inode, file): tells a socket
    that stayed open from a pooled shared-memory segment."""
    kinds: dict[str, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return kinds
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else \
            "/dev/shm" if target.startswith("/dev/shm") else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def snapshot(pids: dict[str, int], with_fd_kinds: bool = False) -> dict[str, dict | None]:
    stats = {label: process_stats(pid) for label, pid in pids.items()}
    if with_fd_kinds:  # only before and after: the peak keeps numbers only
        for label, values in stats.items():
            if values is not None:
                values["fd_kinds"] = fd_kinds(pids[label])
    return stats


# ---- sampling during a burst -----------------------------------------------------------------------------
@dataclass
class BurstSamples:
    num_samples: int = 0
    health_statuses: dict[str, int] = field(default_factory=dict)  # "ok" / "degraded" / "probe failed" -> count
    max_probe_s: float = 0.0
    probe_errors: list[str] = field(default_factory=list)
    has_workers: bool = False  # the aggregated server has none to leave rotation
    left_rotation: list[dict] = field(default_factory=list)  # first unhealthy sighting per worker
    drained: list[dict] = field(default_factory=list)
    peak: dict[str, dict] = field(default_factory=dict)  # label -> max of each stat over the samples


class Sampler:
    """A thread that, every 0.5 s, asks the router's /health and reads /proc for the server's
    processes. A thread, not a task: the client's event loop is saturated by the burst itself."""

    def __init__(self, url: str, pids: dict[str, int]) -> None:
        self.url, self.pids = url, pids
        self.samples = BurstSamples()
        self._stop = threading.Event()
        self._start_s = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="burst-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(HEALTH_PROBE_TIMEOUT_S + 5)

    def _run(self) -> None:
        with httpx.Client(timeout=HEALTH_PROBE_TIMEOUT_S) as http:
            while True:
                self._sample(http)
                if self._stop.wait(SAMPLE_PERIOD_S):
                    break

    def _sample(self, http: httpx.Client) -> None:
        s = self.samples
        s.num_samples += 1
        self._note_resources(snapshot(self.pids))
        t0 = time.perf_counter()
        try:
            report = http.get(f"{self.url}/health").json()  # 503 while degraded: still a JSON report
        except (httpx.HTTPError, ValueError) as err:
            s.health_statuses["probe failed"] = s.health_statuses.get("probe failed", 0) + 1
            if len(s.probe_errors) < MAX_ERRORS_KEPT:
                s.probe_errors.append(f"{type(err).__name__}: {err}"[:200])
            return
        finally:
            s.max_probe_s = max(s.max_probe_s, time.perf_counter() - t0)
        status = str(report.get("status"))
        s.health_statuses[status] = s.health_statuses.get(status, 0) + 1
        self._note_workers(report.get("workers") or {})

    def _note_workers(self, workers: dict[str, list[dict]]) -> None:
        s, at_s = self.samples, round(time.perf_counter() - self._start_s, 2)
        for tier, states in workers.items():
            for w in states:
                s.has_workers = True
                seen = {"tier": tier, "address": w.get("address"), "at_s": at_s, "state": w}
                if w.get("healthy") is False and not any(e["address"] == seen["address"] for e in s.left_rotation):
                    s.left_rotation.append(seen)
                if w.get("draining") and not any(e["address"] == seen["address"] for e in s.drained):
                    s.drained.append(seen)

    def _note_resources(self, stats: dict[str, dict | None]) -> None:
        for label, values in stats.items():
            if values is None:
                continue
            peak = self.samples.peak.setdefault(label, dict(values))
            for key, value in values.items():
                peak[key] = max(peak[key], value)


# ---- one mode ------------------------------------------------------------------------------------------
def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    latencies = sorted(o.latency_s for o in ok)
    errors, seen = [], set()
    for o in outcomes:  # the first few distinct messages, with their status
        key = (o.failure, o.status, o.message)
        if o.failure and key not in seen and len(errors) < MAX_ERRORS_KEPT:
            seen.add(key)
            errors.append({"failure": o.failure, "status": o.status, "message": o.message})
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.failure:
            failures[o.failure] = failures.get(o.failure, 0) + 1
    return {"n": len(outcomes), "ok": len(ok), "failed": len(outcomes) - len(ok),
            "num_5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
            "num_429": sum(o.num_429 for o in outcomes),
            "failed_after_retries": failures.get("429_after_retries", 0),
            "failures": failures, "errors": errors, "wall_s": wall_s,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "latency_p50_s": statistics.median(latencies) if latencies else None,
            "latency_max_s": latencies[-1] if latencies else None}


def measure_burst(server: ServeTree, model: str, n: int, first_seed: int, args: argparse.Namespace) -> dict:
    pids = {**server.labelled_pids(), "client": os.getpid()}
    conversations = build_conversations(n, first_seed, args)  # before the clock: not part of the burst
    before = snapshot(pids, with_fd_kinds=True)
    log_mark = len(server.lines)
    with Sampler(server.url, pids) as sampler:
        outcomes, wall_s = asyncio.run(run_burst(server.url, model, conversations, args))
    time.sleep(AFTER_BURST_WAIT_S)  # "after": has the server let go of the burst's threads and sockets?
    after = snapshot(pids, with_fd_kinds=True)
    samples = sampler.samples
    result = summarize(outcomes, wall_s)
    result.update(
        health={"samples": samples.num_samples, "statuses": samples.health_statuses,
                "max_probe_s": samples.max_probe_s, "probe_errors": samples.probe_errors,
                "has_workers": samples.has_workers, "left_rotation": samples.left_rotation,
                "drained": samples.drained},
        resources={label: {"pid": pids[label], "before": before[label], "peak": samples.peak.get(label),
                           "after": after[label]} for label in pids},
        server_log=server.lines[log_mark:][-20:],
        requests=[asdict(o) for o in outcomes])
    return result


def measure_mode(mode: str, args: argparse.Namespace) -> dict[int, dict]:
    print(f"== {mode}: starting epd serve{' --aggregated' if mode == 'aggregated' else ''} ...", flush=True)
    results: dict[int, dict] = {}
    with ServeTree(mode, args.model, *args.serve_arg, timeout_s=args.start_timeout_s) as server:
        model = served_model(server.url)
        asyncio.run(warm_up(server.url, model, args))
        first_seed = 0  # distinct images across this server's bursts too: no cache hits from an earlier N
        for n in args.n:
            print(f"   burst of {n} ...", flush=True)
            results[n] = measure_burst(server, model, n, first_seed, args)
            first_seed += n
            r = results[n]
            print(f"   done: ok {r['ok']}/{n}, 5xx {r['num_5xx']}, 429s {r['num_429']}, "
                  f"wall {r['wall_s']:.2f} s", flush=True)
    return results


def served_model(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=10.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# ---- report --------------------------------------------------------------------------------------------
def rotation_text(r: dict) -> str:
    h = r["health"]
    if not h["has_workers"]:
        return "n/a (no tiers)"
    return "yes: " + ", ".join(f"{e['tier']} {e['address']} at {e['at_s']} s" for e in h["left_rotation"]) \
        if h["left_rotation"] else "no"


def _fmt_s(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def verdicts(rows: dict[str, dict]) -> dict:
    ratio = rows["epd"]["wall_s"] / rows["aggregated"]["wall_s"] if {"epd", "aggregated"} <= rows.keys() else None
    checks = {"0 failed requests": all(r["failed"] == 0 for r in rows.values()),
              "0 5xx": all(r["num_5xx"] == 0 for r in rows.values())}
    if ratio is not None:
        checks[f"EPD wall <= {TARGET_WALL_RATIO}x aggregated"] = ratio <= TARGET_WALL_RATIO
    return {"epd_over_aggregated_wall": ratio, "checks": checks, "pass": all(checks.values())}


def print_report(results: dict[str, dict[int, dict]], args: argparse.Namespace) -> dict[int, dict]:
    workload = "text only" if args.text_only else f"one {args.image_size}x{args.image_size} noise image each"
    print(f"\nmodel={args.model} max_tokens={args.max_tokens} temperature=0 streaming, {workload}; "
          f"targets: 0 failed, 0 5xx, EPD wall <= {TARGET_WALL_RATIO}x aggregated")
    all_verdicts = {}
    for n in args.n:
        rows = {mode: per_n[n] for mode, per_n in results.items() if n in per_n}
        print(f"\nN={n} concurrent streams")
        print("| mode | ok | failed | 5xx | 429s | failed after retries | wall s | TTFT p50 s | latency max s | "
              "workers out of rotation |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode, r in rows.items():
            print(f"| {mode} | {r['ok']} | {r['failed']} | {r['num_5xx']} | {r['num_429']} | "
                  f"{r['failed_after_retries']} | {r['wall_s']:.2f} | {_fmt_s(r['ttft_p50_s'])} | "
                  f"{_fmt_s(r['latency_max_s'])} | {rotation_text(r)} |")
        v = all_verdicts[n] = verdicts(rows)
        ratio = v["epd_over_aggregated_wall"]
        print(f"EPD wall / aggregated wall: {ratio:.2f}x (target <= {TARGET_WALL_RATIO})" if ratio is not None
              else "EPD wall / aggregated wall: n/a (needs both modes)")
        print("workers out of rotation during burst: " +
              ("; ".join(f"{m}: {rotation_text(r)}" for m, r in rows.items())))
        print("targets: " + ", ".join(f"{name} {'PASS' if ok else 'FAIL'}" for name, ok in v["checks"].items()) +
              f" => {'PASS' if v['pass'] else 'FAIL'}")
        for mode, r in rows.items():
            print_details(mode, r)
    return all_verdicts


def print_details(mode: str, r: dict) -> None:
    h = r["health"]
    print(f"  {mode}: health samples {h['samples']} {h['statuses']}, slowest probe {h['max_probe_s']:.2f} s"
          + (f", failures by kind {r['failures']}" if r["failures"] else ""))
    for e in r["errors"]:
        print(f"    error: {e['failure']} status={e['status']}: {e['message']}")
    for e in h["probe_errors"]:
        print(f"    health probe: {e}")
    for e in h["left_rotation"] + h["drained"]:
        print(f"    worker {e['tier']} {e['address']} at {e['at_s']} s: {e['state']}")
    for line in r["server_log"]:
        print(f"    epd serve: {line}")
    print_resources(mode, r["resources"])


def print_resources(mode: str, resources: dict[str, dict]) -> None:
    print(f"  {mode}: per process (before / peak during / {AFTER_BURST_WAIT_S:.0f} s after the burst)")
    print("  | process | pid | threads | open fds | RSS MiB |")
    print("  |---|---|---|---|---|")
    for label, r in resources.items():
        cells = [" / ".join(_stat(r[when], key) for when in ("before", "peak", "after"))
                 for key in ("threads", "fds", "rss_bytes")]
        print(f"  | {label} | {r['pid']} | {' | '.join(cells)} |")
    for label, r in resources.items():  # what a process kept open after the burst
        before, after = r["before"], r["after"]
        if before and after and after["fds"] > before["fds"]:
            print(f"  {label}: fds before {before['fd_kinds']}, after {after['fd_kinds']}")


def _stat(values: dict | None, key: str) -> str:
    if values is None:
        return "-"
    return f"{values[key] / 2**20:.0f}" if key == "rss_bytes" else str(values[key])


# ---- main ----------------------------------------------------------------------------------------------
def raise_fd_limit() -> int:
    """1,024 streams need more than a default soft limit of 1,024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="64,128,256", help="burst sizes, comma-separated")
    ap.add_argument("--modes", default="epd,aggregated", help="epd (1E1P1D) and/or aggregated, in this order")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="tiny-qwen2-vl")
    ap.add_argument("--image-size", type=int, default=448, help="side of each noise image in pixels")
    ap.add_argument("--text-only", action="store_true", help="no images: text prompts only")
    ap.add_argument("--json", default=None, help="write every number (and each request's outcome) here")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra epd serve argument for every mode, e.g. --serve-arg=--max-queued-requests=2048")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--burst-timeout-s", type=float, default=1800.0, help="a burst's requests still open then fail")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    args.n = [int(x) for x in args.n.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - {"epd", "aggregated"}
    if unknown or not args.modes or not args.n or min(args.n) < 1:
        ap.error(f"--modes takes epd,aggregated (got {unknown or 'none'}); --n positive integers")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fd_limit = raise_fd_limit()
    if fd_limit < max(args.n) + 64:
        print(f"warning: fd limit {fd_limit} is below {max(args.n) + 64}; connections may fail", flush=True)
    results = {mode: measure_mode(mode, args) for mode in args.modes}  # one server at a time: 2 cores
    all_verdicts = print_report(results, args)
    if args.json:
        payload = {"args": vars(args), "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                   "targets": {"failed": 0, "5xx": 0, "epd_over_aggregated_wall_max": TARGET_WALL_RATIO},
                   "results": {mode: {str(n): r for n, r in per_n.items()} for mode, per_n in results.items()},
                   "verdicts": {str(n): v for n, v in all_verdicts.items()}}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"\njson: {args.json}")


if __name__ == "__main__":
    sys.exit(main())
