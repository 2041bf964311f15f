"""Incremental detokenization, O(1) per token: text deltas that never split a UTF-8 character.

A fast tokenizer's own ``DecodeStream`` keeps a small window of recent tokens and returns only the
new text (None while a multi-byte character is incomplete), so a long stream costs the same per
token at its end as at its start; decoding the whole output again for every chunk would cost
O(n) per token and O(n^2) per request. Slow tokenizers get the same windowed method by hand.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._backend = self._stream = None
            self._tokenizer, self._skip = tokenizer, skip_special_tokens
            self._ids: list[int] = []
            self._prefix = self._read = 0  # context window start; first token whose text is not yet out

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is final (an incomplete character at the very
        end of a stream is never emitted)."""
        if self._stream is not None:
            return "".join(piece for t in token_ids if (piece := self._stream.step(self._backend, t)) is not None)
        self._ids.extend(token_ids)
        return self._windowed()

    def _windowed(self) -> str:
        # decode the new tokens with the previous ones as context (spaces and merges depend on it);
        # the window only ever spans the tokens since the last emitted text
        before = self._tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]
