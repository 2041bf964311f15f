"""Workers discovered, not listed: the router keeps a tier's workers equal to what a name resolves
to (a Kubernetes headless Service answers with the IP of every ready pod behind it), so scaling a
tier never touches the router.

Every ``period_s`` each tier's name is resolved; an address that appears joins once it answers
EPD's health RPC as that tier and model (as an admin registration does); one that disappears
(scaled down, or a pod being terminated: its endpoint leaves the Service first) is drained: no new
request goes to it, the ones it holds finish, then it is forgotten. A failed lookup changes
nothing (DNS hiccups must not drain a tier). Statically configured workers are never touched.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from epd.router.workers import WorkerRegistry

log = logging.getLogger("epd.router")

Resolver = Callable[[str], Awaitable[list[str]]]  # "host:port" -> ["ip:port", ...]


async def resolve_service(target: str) -> list[str]:
    """Every address ``host:port`` resolves to, as ``ip:port`` (IPv6 in brackets), sorted."""
    host, _, port = target.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    ips = {info[4][0] for info in infos}
    return sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)


class DnsDiscovery:
    def __init__(self, registry: WorkerRegistry, services: dict[str, str], *, period_s: float = 5.0,
                 drain_timeout_s: float = 60.0, expected_model: str | None = None,
                 resolve: Resolver = resolve_service) -> None:
        """``services``: tier -> ``host:port`` to resolve (tiers without one keep their static list)."""
        self.registry, self.services, self.period_s = registry, dict(services), period_s
        self.drain_timeout_s, self.expected_model, self.resolve = drain_timeout_s, expected_model, resolve
        self.discovered: dict[str, set[str]] = {tier: set() for tier in self.services}
        self._draining: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._draining):
            task.cancel()

    async def refresh(self) -> None:
        """One round: every tier's name resolved, its workers made to match."""
        await asyncio.gather(*(self._refresh_tier(tier, target) for tier, target in self.services.items()))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.refresh()

    async def _refresh_tier(self, tier: str, target: str) -> None:
        try:
            found = set(await self.resolve(target))
        except (OSError, ValueError) as err:
            log.warning("discovery: cannot resolve %s for %s (%s); its workers are kept", target, tier, err)
            return
        known = self.discovered[tier]
        for address in sorted(found - known):
            try:
                await self.registry.add(tier, address, expected_model=self.expected_model)
            except ValueError as err:  # not (yet) an EPD worker of this model: asked again next round
                log.info("discovery: %s %s not added: %s", tier, address, err)
                continue
            known.add(address)
            log.info("discovery: %s %s joined", tier, address)
        for address in sorted(known - found):
            known.discard(address)
            task = asyncio.create_task(self._drain(tier, address))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    async def _drain(self, tier: str, address: str) -> None:
        log.info("discovery: %s %s left %s; draining", tier, address, self.services[tier])
        drained = await self.registry.remove(tier, address, self.drain_timeout_s)
        if not drained:
            log.warning("discovery: %s %s still held requests after %.0f s; forgotten anyway", tier, address,
                        self.drain_timeout_s)
