"""The router's stats line, every ``log_stats_interval_s`` (10 s) while anything happens, as vLLM's
engine prints its own: throughput, requests running and waiting (the router's and each engine
tier's), decode's KV usage, what the encoders encoded, and the requests moved off lost workers.
``--disable-log-stats`` turns it off.

    stats: 35.1 prompt, 412.0 generation tokens/s; requests 12 running, 3 waiting; prefill 1 running,
    0 waiting, busy 35%; decode 11 running, 2 waiting, KV 41%, busy 100%; encoded 6 of 10 items
    (encoder cache hits 40%), encoders busy 20%; moved 0
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("epd.router")


@dataclass
class _Counts:
    at_s: float
    prompt_tokens: float
    generation_tokens: float
    encoded_items: float
    handed_items: float  # embeddings handed from encoders to prefill: every item a request needed
    moves: float


class StatsLog:
    """Reads the router's own metrics (``pipeline.metrics``, refreshed first) and its view of the
    workers (``pipeline.health()``); ``line()`` -> the line for the interval since the last call,
    or None when nothing ran in it."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self._last = self._counts(self._tiers())

    def _tiers(self) -> dict:
        """The metrics brought up to now, and the router's view of each tier's workers."""
        self.pipeline.refresh_metrics()
        return self.pipeline.health().get("workers", {})

    def _counts(self, tiers: dict) -> _Counts:
        value = self.pipeline.metrics.own.get_sample_value

        def total(name: str, stages=()) -> float:
            if not stages:
                return value(name) or 0.0
            return sum(value(name, labels) or 0.0 for labels in stages)

        moves = total("epd_request_moves_total", [{"stage": s} for s in ("redispatched", "migrated")])
        encoders = [{"tier": "encoder", "worker": w["address"]} for w in tiers.get("encoder", [])]
        handed = total("epd_tensor_handoffs_total", [{"stage": "embeddings", "placement": p}
                                                     for p in ("same_host", "cross_host")])
        return _Counts(time.monotonic(), total("epd_prompt_tokens_total"), total("epd_output_tokens_total"),
                       total("epd_encoder_encoded_items_total", encoders), handed, moves)

    def line(self) -> str | None:
        tiers = self._tiers()
        now, last = self._counts(tiers), self._last
        self._last = now
        value = self.pipeline.metrics.own.get_sample_value
        running, waiting = value("epd_router_in_flight") or 0, value("epd_router_queue_depth") or 0
        if not running and not waiting and now.generation_tokens == last.generation_tokens \
                and now.prompt_tokens == last.prompt_tokens:
            return None  # idle: nothing to say
        seconds = max(now.at_s - last.at_s, 1e-9)
        parts = [f"stats: {(now.prompt_tokens - last.prompt_tokens) / seconds:.1f} prompt, "
                 f"{(now.generation_tokens - last.generation_tokens) / seconds:.1f} generation tokens/s",
                 f"requests {running:.0f} running, {waiting:.0f} waiting"]
        for tier in ("prefill", "decode"):
            workers = [w for w in tiers.get(tier, []) if w.get("healthy")]
            if workers:
                kv = f", KV {100 * max(w['kv_usage'] for w in workers):.0f}%" if tier == "decode" else ""
                parts.append(f"{tier} {sum(w['running'] for w in workers)} running, "
                             f"{sum(w['waiting'] for w in workers)} waiting{kv}{_busy(workers, ', busy')}")
        if "encoder" in tiers:
            encoded, handed = now.encoded_items - last.encoded_items, now.handed_items - last.handed_items
            hits = f" (encoder cache hits {100 * max(0.0, 1 - encoded / handed):.0f}%)" if handed else ""
            busy = _busy([w for w in tiers["encoder"] if w.get("healthy")], ", encoders busy")
            parts.append(f"encoded {encoded:.0f} of {handed:.0f} items{hits}{busy}")
        parts.append(f"moved {now.moves - last.moves:.0f}")
        return "; ".join(parts)

    async def run(self, interval_s: float) -> None:
        """Log ``line()`` every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if (text := self.line()) is not None:
                    log.info(text)
            except Exception:  # noqa: BLE001 - a stats line must never take the router down
                log.exception("stats line failed")


def _busy(workers: list[dict], words: str) -> str:
    """``words`` and the mean share of the time between their last health answers that the
    workers' engines worked ("" where none counts it)."""
    known = [w["busy"] for w in workers if "busy" in w]
    return f"{words} {100 * sum(known) / len(known):.0f}%" if known else ""

