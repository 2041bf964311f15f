"""Incremental detokenization: text deltas that never split a UTF-8 character."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is final (held back while a byte sequence is
        incomplete, which the tokenizer renders as U+FFFD)."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
