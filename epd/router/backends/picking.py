"""Which worker of a tier takes a request: a routing policy's pick among the workers in rotation
(on one host when the request's tensors can only go there), and the request counted on it while
it is there."""
from __future__ import annotations

import contextlib

from epd.errors import Unavailable, UpstreamError
from epd.router.workers import WorkerRegistry, WorkerState


class Picker:
    def __init__(self, workers: WorkerRegistry, policies: dict) -> None:
        self.workers = workers
        self.policies = policies  # tier -> its routing policy

    @contextlib.contextmanager
    def holding(self, tier: str, key: str = "", *, address: str | None = None, host_id: str | None = None,
                 is_started: bool = False):
        """Pick a worker (or take ``address``; with ``host_id``, one on that host) and count the
        request on it while the block runs. The state itself is held: a worker being drained stays
        reachable until we let go."""
        worker = self.workers.get(tier, address or self.pick(tier, key, host_id, is_started=is_started))
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def encoder_hosts(self) -> dict[str, str]:
        """The encoders in rotation: address -> host id."""
        return {c.address: self.workers.get("encoder", c.address).host_id for c in self.workers.candidates("encoder")}

    def encoders(self, avoid: set[str]) -> list:
        return passing_over(self.workers.candidates("encoder"), avoid)

    def pick(self, tier: str, key: str, host_id: str | None = None, *, is_started: bool = False,
              avoid: set[str] = frozenset()) -> str:
        """A worker of ``tier`` in rotation (on ``host_id``'s host when given). Requests wait for every
        tier they need before they start, so none here means the tier went out since: a request
        already holding work elsewhere (``is_started``: its rows being encoded, its KV waiting)
        moves, so it is dispatched again once a worker is back, within its queue budget and
        deadline; one not started yet is refused (503)."""
        candidates = passing_over(self.workers.candidates(tier, host_id), avoid)
        if not candidates and host_id is not None and self.workers.candidates(tier):
            # the tensor handed over cannot reach the others: dispatch the request again
            raise UpstreamError(f"no {tier} worker in rotation on host {host_id}, where the request's tensors are")
        if not candidates and is_started:
            raise UpstreamError(f"no {tier} worker in rotation to go on with the request")
        if not candidates:
            raise Unavailable(f"no healthy {tier} worker ({len(self.workers.workers[tier])} configured)")
        return self.policies[tier].pick(key, candidates)

    def kv_consumer_host(self, prefill: WorkerState) -> str:
        """Where prefill's KV will go: its own host when a decode worker is there (shm / CUDA IPC
        then), else another decode worker's (inline / NCCL); decode follows what prefill chose."""
        decodes = {w.address: w.host_id for w in self.workers.workers.get("decode", [])}
        hosts = [decodes[c.address] for c in self.workers.candidates("decode")]
        return prefill.host_id if prefill.host_id in hosts or not hosts else hosts[0]


def passing_over(candidates: list, avoid: set[str]) -> list:
    """The candidates not in ``avoid``, or all of them when that leaves none (a preference)."""
    return [c for c in candidates if c.address not in avoid] or candidates
