"""Stop strings over streamed text: the output ends just before the first match, which may span
several deltas. Text that could still grow into a stop string is held back until the next delta
decides it (tokens are never held back)."""
from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""  # text received but not yet released: a suffix that is a prefix of a stop

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text that is safe to send now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[:min(hits)], True
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:k]):
                    best = k
                    break
        return best
