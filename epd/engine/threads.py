"""One CPU thread policy for every process that computes: a tier, the aggregated router, ``epd.LLM``.

Why: torch runs a parallel op as an OpenMP team whose threads meet at a barrier after every region.
When a process holds more busy threads than the cores it may use, the kernel deschedules some team
member, and the whole team waits for it at the next barrier; libgomp then also stops spin-waiting
between regions, so every matmul pays futex wake-ups. torch's default team is one thread per core of
the *machine* (``os.cpu_count()``), blind to the process's affinity mask, its cgroup quota and its
own other busy threads: an asyncio event loop in the same process (the aggregated router) is one of
them. On 2 cores the aggregated server measured TTFT p50 499 ms with torch's default and 35 ms with
one intra-op thread.

So the intra-op team is sized from the cores this process may use, minus the threads it keeps busy
besides the engine thread. Precedence: an explicit count (the ``num_threads`` config field / the
``--num-threads`` flag) > ``EPD_NUM_THREADS`` > ``OMP_NUM_THREADS`` (the user's explicit choice) >
``max(1, usable cores - busy threads)``.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("epd.engine.threads")

EPD_NUM_THREADS = "EPD_NUM_THREADS"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
_logged: set[tuple[str, int]] = set()  # (role, threads) already logged by this process


def usable_cores(cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota
    (rounded up: a quota of 1.5 CPUs still spreads over 2 cores), at least 1.

    ``cgroup_root`` is the process's own cgroup as a container sees it (cgroup namespaces: Docker,
    Kubernetes); the quota of a parent cgroup outside the namespace is not visible there."""
    cores = len(os.sched_getaffinity(0))
    quota_cpus = cgroup_quota_cpus(Path(cgroup_root))
    if quota_cpus is not None:
        cores = min(cores, math.ceil(quota_cpus))
    return max(1, cores)


def cgroup_quota_cpus(root: Path) -> float | None:
    """CPUs the cgroup's quota grants per period (cgroup v2 ``cpu.max``, else v1 CFS files);
    None when there is no quota or it cannot be read."""
    v2 = _read(root / "cpu.max")  # "<quota> <period>" or "max <period>"
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else _ratio(quota, period or "100000")
    for controller in ("cpu", "cpu,cpuacct"):
        quota, period = _read(root / controller / "cpu.cfs_quota_us"), _read(root / controller / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return _ratio(quota, period)  # quota -1: unlimited
    return None


def intra_op_threads(busy_threads: int, *, override: int | None = None,
                     environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(intra-op threads, why) for a process that keeps ``busy_threads`` threads busy besides the
    one running torch ops; see the module docstring for the precedence."""
    environ = os.environ if environ is None else environ
    if override is not None:
        if override < 1:
            raise ValueError(f"num_threads must be a positive integer, got {override!r}")
        return override, f"num_threads={override}"
    for name in (EPD_NUM_THREADS, OMP_NUM_THREADS):
        threads = _env_threads(environ, name)
        if threads is not None:
            return threads, f"{name}={threads}"
    cores = usable_cores()
    threads = max(1, cores - busy_threads)
    busy = f" - {busy_threads} busy thread{'s' if busy_threads != 1 else ''}" if busy_threads else ""
    return threads, f"{cores} usable core{'s' if cores != 1 else ''}{busy}"


def apply_thread_policy(role: str, *, busy_threads: int = 0, override: int | None = None) -> int:
    """Size torch's intra-op threads by the policy and return the count. Call it on the thread that
    will run the torch ops: torch applies the count there, and threads that have not run a parallel
    op yet pick it up when they first do; a thread that already has its team keeps its own size."""
    import torch  # importing this module must stay cheap (configs, launchers)

    threads, why = intra_op_threads(busy_threads, override=override)
    torch.set_num_threads(threads)
    if (role, threads) not in _logged:
        _logged.add((role, threads))
        log.info("%s: %d intra-op threads (%s)", role, threads, why)
    return threads


@dataclass(frozen=True)
class ThreadPolicy:
    """The policy of one engine thread, applied by the loop that owns that thread."""

    role: str  # names the engine in the log line ("prefill", "aggregated engine")
    busy_threads: int = 0  # other threads of the process that keep a core busy (an event loop: 1)
    override: int | None = None  # the num_threads config field, if set

    def apply(self) -> int:
        return apply_thread_policy(self.role, busy_threads=self.busy_threads, override=self.override)


# ---- helpers -----------------------------------------------------------------------------------
def _env_threads(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:  # unset or empty: no choice made (OpenMP ignores an empty value too)
        return None
    first = raw.split(",")[0].strip() if name == OMP_NUM_THREADS else raw  # OpenMP: "outer,inner,..." levels
    try:
        threads = int(first)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer (intra-op CPU threads)")
    return threads


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # an unexpected format: no quota we can trust
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
