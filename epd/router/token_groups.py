"""``--stream-interval N``: a request's tokens reach its client in groups of N after the first.

At thousands of streams a router spends most of its time per event, not per token: the event, the
detokenizer's call, the frame, the socket write and the client's wake-up cost the same for one
token as for several. Holding a request's tokens until N have come divides all of that by N, for
a stream that moves in steps of N tokens. The first token is never held (it is the request's
TTFT), nor the one that finishes it (nothing may wait behind the last token), so a group is what
came since the last one went out, at least N tokens, or fewer at the end.

What a client sees is otherwise the same: the text stream handles a group as it handles the
tokens of a reader that fell behind (stop strings end it at the token that completed them, its
usage counts the tokens it sent; ``epd.router.pipeline``).
"""
from __future__ import annotations

from epd.router.backends.base import BackendOutput


class TokenGroups:
    """One request's outputs, held until a group is due (``take``), merged into one."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: list[BackendOutput] = []
        self._num_held = 0  # tokens in _held

    def take(self, output: BackendOutput, *, first: bool) -> BackendOutput | None:
        """``output`` added -> the group now due (merged), or None while it is not."""
        if self.interval == 1 and not self._held:
            return output
        self._held.append(output)
        self._num_held += len(output.token_ids)
        if first or output.finish_reason is not None or self._num_held >= self.interval:
            return self.flush()
        return None

    def flush(self) -> BackendOutput | None:
        """Whatever is held, as one output (None: nothing)."""
        held, self._held, self._num_held = self._held, [], 0
        if len(held) <= 1:
            return held[0] if held else None
        return BackendOutput([t for out in held for t in out.token_ids], [lp for out in held for lp in out.logprobs],
                             held[-1].finish_reason, held[0].num_cached_tokens)
