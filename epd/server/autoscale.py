"""``epd serve``'s side of the online planner: it carries out what the router's planner wants
(``GET /admin/plan`` on the router's admin API, ``epd.router.autoscale``). A tier short of workers
gets one started (``LocalCluster.add_worker``) and, once it is ready, registered with the router
(``POST /admin/workers``: it enters rotation at once); a tier with one too many has its newest
worker drained by the router (``DELETE /admin/workers``: no new requests, the running ones finish)
and then stopped (``LocalCluster.retire``). So a worker moves from decode to encode without a
request failing. One round runs with each round of supervision."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from epd.plan.autoscale import TIERS
from epd.server.admin_client import admin_request

_DRAIN_TIMEOUT_S = 120.0
_READY_TIMEOUT_S = 300.0


@dataclass
class LocalScaler:
    cluster: object  # LocalCluster
    admin_url: str
    token: str
    _starting: list = field(default_factory=list)  # workers started, not registered yet
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # from the drain threads

    def reconcile(self) -> list[str]:
        """One round -> what happened, one line per event (a router that does not answer: nothing)."""
        events = self._register_ready()
        try:
            plan = self._call("GET", "/admin/plan")
        except (OSError, ValueError, KeyError):
            plan = None
        if plan is not None:
            reason = plan["decisions"][-1]["reason"] if plan["decisions"] else ""
            for tier in TIERS:
                # not one leaving, nor one left down after its restarts: the planner counts workers in
                # rotation, so a worker given up is replaced (else the plan would never be carried out)
                have = [p for p in self.cluster.processes if p.tier == tier and not p.given_up]
                want = plan["desired"].get(tier, len(have))
                for _ in range(want - len(have)):
                    p = self.cluster.add_worker(tier)
                    self._starting.append(p)
                    events.append(f"autoscale: starting a {tier} worker (pid {p.proc.pid}): {reason}")
                if want < len(have) and not any(p.tier == tier for p in self._starting):
                    self._retire(have[-1], reason)
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def _register_ready(self) -> list[str]:
        events = []
        for p in list(self._starting):
            if p.proc.poll() is not None or (p.address is None and p.started_s + _READY_TIMEOUT_S < time.monotonic()):
                self._starting.remove(p)  # it died starting: the planner sees the tier short and asks again
                self.cluster.retire(p, timeout_s=5.0)
                events.append(f"autoscale: the new {p.tier} worker (pid {p.proc.pid}) did not start "
                              f"(exit code {p.proc.poll()}): {p.tail(5)}")
                continue
            if p.address is None:
                continue
            try:
                self._call("POST", "/admin/workers", {"tier": p.tier, "address": p.address})
            except (OSError, ValueError, KeyError) as err:
                events.append(f"autoscale: registering {p.tier} {p.address} failed ({err}); trying again")
                continue
            self._starting.remove(p)
            events.append(f"autoscale: {p.tier} {p.address} (pid {p.proc.pid}) in rotation")
        return events

    def _retire(self, p, reason: str) -> None:
        """Drain it at the router, then stop it, on a thread of its own (draining waits for its
        requests to finish)."""
        p.given_up = True  # supervision leaves it alone, and the tier no longer counts it

        def run() -> None:
            try:
                drained = self._call("DELETE", "/admin/workers", {"tier": p.tier, "address": p.address,
                                                                  "drain_timeout_s": _DRAIN_TIMEOUT_S},
                                     timeout_s=_DRAIN_TIMEOUT_S + 10)["drained"]
            except (OSError, ValueError, KeyError) as err:
                drained = f"not drained ({err})"
            code = self.cluster.retire(p)
            self._events.put(f"autoscale: {p.tier} {p.address} (pid {p.proc.pid}) drained ({drained}) and stopped "
                             f"(exit code {code}): {reason}")

        self._events.put(f"autoscale: draining {p.tier} {p.address} (pid {p.proc.pid}): {reason}")
        threading.Thread(target=run, name=f"autoscale-retire-{p.tier}", daemon=True).start()

    def _call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 5.0) -> dict:
        return admin_request(self.admin_url, self.token, method, path, body, timeout_s)
