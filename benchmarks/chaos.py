"""Chaos under load: ``epd serve`` with 2 encoders, 2 prefills and 2 decodes, streaming clients looping
over a fixed set of chats (greedy and seeded, multi-image, logprobs, a stop string, usage), and one
fault per tier in turn: kill -9 of a worker (``kill:decode``), or SIGSTOP of one for a while
(``stop:decode``: alive but wedged). Prints, per fault, the requests that started in the 10 s
before and the 15 s after it, their failures and p50/p99 TTFT, the requests the router moved
(re-dispatched before the first token, migrated mid-stream), when the dead worker's shared memory
was gone and when it was back in rotation; then every answer is checked token for token against
the chat's fault-free answer, taken before the first fault.

    python benchmarks/chaos.py [--faults kill:encoder,kill:prefill,kill:decode,stop:decode]
        [--clients 8] [--max-tokens 48] [--gap-s 25] [--json PATH] [--serve-arg=--flag ...]

Targets: 0 failed requests, 0 answers that differ from their reference, every killed worker back in
rotation. Only loopback; the ``epd serve`` tree is always stopped, every wait is bounded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

from common import Server

from epd.bench.chaos import (
    LoopingClients,
    chats,
    in_rotation,
    mismatches,
    moves,
    references,
    restarted_pid,
    segments_of,
    stop_twin,
    window_stats,
    worker_pids,
)

BEFORE_S, AFTER_S = 10.0, 15.0
STOPPED_FOR_S = 20.0  # a SIGSTOPped worker is continued after this (it must have been left by then)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen2-vl")
    p.add_argument("--faults", default="kill:encoder,kill:prefill,kill:decode,stop:decode")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--gap-s", type=float, default=25.0, help="time between faults (recovery is measured in it)")
    p.add_argument("--seed", type=int, default=0, help="seeds the chats' images and when each fault lands")
    p.add_argument("--json", help="write the report here too")
    p.add_argument("--serve-arg", action="append", default=[], help="extra epd serve flag (repeatable)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    serve_args = ["--encoders", "2", "--prefills", "2", "--decodes", "2", "--health-timeout-s", "2",
                  *args.serve_arg]
    report = {"faults": [], "config": vars(args)}
    with Server("epd", args.model, *serve_args) as server:
        chat_list = chats(args.max_tokens, args.seed)
        refs = references(server.url, args.model, chat_list)
        twin = stop_twin(chat_list[0], refs[chat_list[0].name])
        if twin is not None:
            chat_list.append(twin)
            refs.update(references(server.url, args.model, [twin]))
        pids = worker_pids(server.lines)
        with LoopingClients(server.url, args.model, chat_list, args.clients) as clients:
            _wait(lambda: clients.num_ok >= 2 * args.clients, 120)
            for fault in args.faults.split(","):
                action, tier = fault.split(":")
                time.sleep(rng.uniform(0.0, 2.0))  # a random point: mid-encode, mid-prefill or mid-stream
                report["faults"].append(_inject(server, clients, pids, action, tier, args.gap_s))
            time.sleep(AFTER_S)
        outcomes = clients.snapshot()
        report["moves"] = moves(server.url)
    for f in report["faults"]:
        f.update(before=window_stats(outcomes, f["at_s"] - BEFORE_S, f["at_s"]),
                 after=window_stats(outcomes, f["at_s"], f["at_s"] + AFTER_S))
    report.update(requests=len(outcomes), failed=[f"{o.chat}: {o.status} {o.error}" for o in outcomes if not o.ok],
                  mismatched=mismatches(outcomes, refs))
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not report["failed"] and not report["mismatched"] else 1


def _inject(server, clients, pids, action: str, tier: str, gap_s: float) -> dict:
    address, pid = pids[tier][0]
    seen = len(server.lines)
    at_s = clients.now_s()
    entry = {"fault": f"{action}:{tier}", "address": address, "pid": pid, "at_s": round(at_s, 1)}
    if action == "kill":
        os.kill(pid, signal.SIGKILL)
        since = time.monotonic()  # every figure below is seconds after the kill
        entry["shm_gone_s"] = _wait(lambda: not segments_of(pid), 30, since=since)
        entry["restarted_s"] = _wait(lambda: restarted_pid(server.lines, tier, address, seen) is not None, 60,
                                     since=since)
        entry["back_in_rotation_s"] = _wait(lambda: restarted_pid(server.lines, tier, address, seen) is not None
                                            and in_rotation(server.url, tier, address), 120, since=since)
        new_pid = restarted_pid(server.lines, tier, address, seen)
        if new_pid is not None:
            pids[tier][0] = (address, new_pid)
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            entry["out_of_rotation_s"] = _wait(lambda: not in_rotation(server.url, tier, address), STOPPED_FOR_S)
            time.sleep(max(0.0, STOPPED_FOR_S - (clients.now_s() - at_s)))
        finally:
            os.kill(pid, signal.SIGCONT)
        entry["back_in_rotation_s"] = _wait(lambda: in_rotation(server.url, tier, address), 60)  # after SIGCONT
    time.sleep(max(0.0, gap_s - (clients.now_s() - at_s)))
    print(f"  {entry}", file=sys.stderr, flush=True)
    return entry


def _wait(predicate, timeout_s: float, period_s: float = 0.1, since: float | None = None) -> float | None:
    """Seconds from ``since`` (default: now) until ``predicate`` held; None if it did not within
    ``timeout_s`` of now."""
    start = time.monotonic()
    since = start if since is None else since
    while time.monotonic() - start < timeout_s:
        if predicate():
            return round(time.monotonic() - since, 1)
        time.sleep(period_s)
    return None


def _print(report: dict) -> None:
    print("(shm_gone_s, restart_s, back_s: seconds after the kill; for stop:, out_s is when it left rotation)")
    print(f"{'fault':<14} {'at_s':>6} {'shm_gone_s':>10} {'restart_s':>9} {'back_s':>7} {'out_s':>6} | "
          f"{'before: n':>9} {'fail':>4} "
          f"{'p50':>7} {'p99':>7} | {'after: n':>8} {'fail':>4} {'p50':>7} {'p99':>7}")
    for f in report["faults"]:
        b, a = f["before"], f["after"]
        print(f"{f['fault']:<14} {f['at_s']:>6} {str(f.get('shm_gone_s', '-')):>10} "
              f"{str(f.get('restarted_s', '-')):>9} {str(f.get('back_in_rotation_s')) if 'shm_gone_s' in f else '-':>7} "
              f"{str(f.get('out_of_rotation_s', '-')):>6} | {b['requests']:>9} {b['failed']:>4} {str(b['ttft_p50_ms']):>7} "
              f"{str(b['ttft_p99_ms']):>7} | {a['requests']:>8} {a['failed']:>4} {str(a['ttft_p50_ms']):>7} "
              f"{str(a['ttft_p99_ms']):>7}")
    print(f"requests {report['requests']}, failed {len(report['failed'])}, differing from their reference "
          f"{len(report['mismatched'])}, moved {report['moves']}")
    for line in (report["failed"] + report["mismatched"])[:10]:
        print("  " + line)


if __name__ == "__main__":
    sys.exit(main())
