"""Routing policies: pick a worker of a tier for a key, given each worker's load.

Rendezvous (highest-random-weight) hashing keeps a key on the same worker while the set of
workers changes only where it must; weighting it by 1 / (1 + load) lets a busy worker shed keys.
A repeated image lands on the encoder that cached it; a repeated prompt prefix on the prefill
worker that holds its KV blocks.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from epd.registry import Registry


@dataclass(frozen=True)
class Candidate:
    address: str
    load: float  # in-flight requests (router view) plus the worker's own reported queue


class RoutingPolicy(Protocol):
    def pick(self, key: str, candidates: Sequence[Candidate]) -> str: ...


ROUTING_POLICIES: Registry[type] = Registry("routing policy")


def _unit_hash(*parts: str) -> float:
    digest = hashlib.blake2b("|".join(parts).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / (2**64 + 2)  # in (0, 1)


def rendezvous_score(key: str, candidate: Candidate, load_weight: float) -> float:
    weight = 1.0 / (1.0 + load_weight * candidate.load)
    return -weight / math.log(_unit_hash(candidate.address, key))


@ROUTING_POLICIES.register("hash_affinity")
class HashAffinity:
    """Same key -> same worker unless it is much busier than the others."""

    def __init__(self, load_weight: float = 0.5) -> None:
        self.load_weight = load_weight

    def pick(self, key: str, candidates: Sequence[Candidate]) -> str:
        _require(candidates)
        return max(candidates, key=lambda c: rendezvous_score(key, c, self.load_weight)).address


@ROUTING_POLICIES.register("prefix_affinity")
class PrefixAffinity(HashAffinity):
    """The key is the prompt's leading tokens (and images): shared prefixes meet their KV."""


@ROUTING_POLICIES.register("least_loaded")
class LeastLoaded:
    def __init__(self) -> None:
        self._tie = itertools.count()

    def pick(self, key: str, candidates: Sequence[Candidate]) -> str:
        _require(candidates)
        lowest = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == lowest]
        return tied[next(self._tie) % len(tied)].address


@ROUTING_POLICIES.register("round_robin")
class RoundRobin:
    def __init__(self) -> None:
        self._next = itertools.count()

    def pick(self, key: str, candidates: Sequence[Candidate]) -> str:
        _require(candidates)
        return candidates[next(self._next) % len(candidates)].address


def _require(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise LookupError("no healthy worker to route to")
