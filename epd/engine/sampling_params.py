"""Per-request sampling parameters (plain Python; no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's only; k: plus top-k

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"in [0, max_tokens={self.max_tokens}]",
               self.min_tokens)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 or >= 1", self.top_k)
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "None or in [0, 20]", self.logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {got!r}")
