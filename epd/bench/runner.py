"""One benchmark run: send the workload's requests at their arrival times (under an optional
concurrency cap), stop issuing at ``max_duration_s``, cancel what is still running at the grace
deadline, sample the router's ``/metrics`` while it runs, and show progress on stderr."""
from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from epd.bench.client import RequestRecord
from epd.bench.metrics import MetricsSampler
from epd.bench.workload import RequestSpec


@dataclass
class RunResult:
    rate: float
    records: list[RequestRecord]
    duration_s: float  # first send to the last request's end (or the grace deadline)
    num_not_sent: int = 0  # requests never issued because max_duration_s passed
    metrics_before: dict | None = None
    metrics_after: dict | None = None
    metrics_samples: list[dict] = field(default_factory=list)


class Progress:
    """Progress on stderr through tqdm: a live bar on a terminal; otherwise (CI, a log file) tqdm's
    own line printed every ~10% of the requests, so logs stay readable."""

    def __init__(self, total: int, label: str = "", *, stream=None, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.done = self.failed = self.in_flight = 0
        self._last_decile = -1
        self._last_state: tuple | None = None
        self._bar = tqdm(total=total, desc=label.strip() or None, file=self.stream, unit="req", leave=True,
                         dynamic_ncols=True, mininterval=0.1) if enabled and self.tty else None

    def update(self, *, done: int = 0, failed: int = 0, started: int = 0) -> None:
        self.done += done
        self.failed += failed
        self.in_flight += started - done
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(done)
        else:
            self.draw()

    def _postfix(self) -> str:
        return f"{self.failed} failed, {self.in_flight} in flight"

    def line(self) -> str:
        """tqdm's meter for the current state (what a terminal shows, as one line)."""
        return tqdm.format_meter(self.done, max(self.total, 1), time.perf_counter() - self.t0, ncols=100, ascii=True,
                                 prefix=self.label.strip(), unit="req", postfix=self._postfix())

    def draw(self, *, force: bool = False) -> None:
        if not self.enabled or self._bar is not None:
            return
        decile = int(10 * self.done / max(self.total, 1))
        state = (self.done, self.failed, self.total)
        if (force and state != self._last_state) or decile > self._last_decile:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self._last_decile, self._last_state = decile, state

    def close(self) -> None:
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.set_postfix_str(self._postfix())
            self._bar.close()
        elif self.enabled:
            self.draw(force=True)


async def run_once(driver, requests: list[RequestSpec], *, sampler: MetricsSampler | None = None,
                   **options) -> RunResult:
    """Send ``requests`` through ``driver`` (``await driver.send(spec, record, run_t0)``), scraping
    ``sampler``'s endpoints before, during and after; ``options``: ``_run_once``'s."""
    try:
        return await _run_once(driver, requests, sampler=sampler, **options)
    finally:
        if sampler is not None:  # its HTTP client lives for the run
            await sampler.aclose()


async def _run_once(driver, requests: list[RequestSpec], *, rate: float, max_concurrency: int | None = None,
                    max_duration_s: float | None = None, grace_s: float = 10.0, sampler: MetricsSampler | None = None,
                    settle_s: float = 0.0, progress: bool = True, label: str = "") -> RunResult:
    """``settle_s``: wait this long before each of the before / after scrapes, so gauges the router
    refreshes from its periodic health checks (the cluster view) include earlier work."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = Progress(len(requests), label, enabled=progress)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    if sampler and settle_s > 0:
        await asyncio.sleep(settle_s)
    metrics_before = await sampler.scrape() if sampler else None
    sampling_task = asyncio.create_task(sampler.run()) if sampler else None

    t0 = time.perf_counter()
    last_end = [t0]

    async def one(spec: RequestSpec, record: RequestRecord) -> None:
        try:
            if semaphore is not None:
                async with semaphore:
                    await _send(spec, record)
            else:
                await _send(spec, record)
        finally:
            last_end[0] = max(last_end[0], time.perf_counter())

    async def _send(spec: RequestSpec, record: RequestRecord) -> None:
        bar.update(started=1)
        try:
            await driver.send(spec, record, t0)
        finally:
            bar.update(done=1, failed=0 if record.ok else 1)

    num_not_sent = 0
    bar.draw(force=True)
    try:
        for i, spec in enumerate(requests):
            now = time.perf_counter() - t0
            if max_duration_s is not None and max(now, spec.arrival_s) >= max_duration_s:
                num_not_sent = len(requests) - i
                break
            if spec.arrival_s > now:
                await asyncio.sleep(spec.arrival_s - now)
            record = RequestRecord(index=spec.index, rate=rate, scheduled_s=spec.arrival_s,
                                   num_images=spec.num_images, num_repeated_images=spec.num_repeated_images)
            records.append(record)
            tasks.append(asyncio.create_task(one(spec, record)))
        bar.total = len(tasks)
        if tasks:
            timeout = None
            if max_duration_s is not None:
                timeout = max(0.0, max_duration_s + grace_s - (time.perf_counter() - t0))
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                last_end[0] = time.perf_counter()
    finally:
        for task in tasks:  # an interrupted run (Ctrl-C) cancels what it started
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
        if sampling_task is not None:
            sampling_task.cancel()
            await asyncio.gather(sampling_task, return_exceptions=True)
    for record in records:
        if record.status == "pending":
            record.status = "cancelled" if record.start_s is not None else "not_started"
            record.error = record.error or "cancelled at the run's deadline"
    if sampler and settle_s > 0:
        await asyncio.sleep(settle_s)
    metrics_after = await sampler.scrape() if sampler else None
    duration = max(last_end[0] - t0, 1e-9)
    return RunResult(rate=rate, records=records, duration_s=duration, num_not_sent=num_not_sent,
                     metrics_before=metrics_before, metrics_after=metrics_after,
                     metrics_samples=list(sampler.samples) if sampler else [])


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
