"""Stop strings over streamed text: the output ends just before the first match (or just after it,
with ``include_in_output``, vLLM's ``include_stop_str_in_output``), which may span several deltas.
Text that could still grow into a stop string is held back until the next delta decides it (tokens
are never held back; the pipeline feeds an output of several tokens one token at a time, so the
tokens a stop ends with never depend on how they were batched)."""
from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str], *, include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self._held = ""  # text received but not yet released: a suffix that is a prefix of a stop

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text that is safe to send now, the stop string that was hit or None)."""
        if not self.stops:
            return text, None
        buffer = self._held + text
        hits = [(i, -len(s), s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            self._held = ""
            at, _, stop = min(hits)  # the earliest match; of two at one place, the longer
            return buffer[:at + (len(stop) if self.include_in_output else 0)], stop
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], None

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
