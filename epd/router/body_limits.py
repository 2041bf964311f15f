"""What one chat request may hold, for every front end (HTTP and gRPC): checked on the raw
messages before any heavy work (parsing them into the request model, fetching media, tokenizing),
and refused naming the limit, so a client cannot make the router spend memory or time on a request
it would refuse anyway."""
from __future__ import annotations

from dataclasses import dataclass

from epd.errors import InvalidRequest


@dataclass(frozen=True)
class BodyLimits:
    """What one request body may hold; each is checked before any heavy work (decoding the JSON into
    the request model, fetching media, tokenizing) and refused naming the limit."""

    max_body_bytes: int = 100 * 1024 * 1024
    max_messages: int = 1024
    max_content_parts: int = 4096
    max_text_chars: int = 2_000_000

    @classmethod
    def from_config(cls, config) -> "BodyLimits":
        return cls(config.max_request_body_bytes, config.max_messages, config.max_content_parts,
                   config.max_text_chars)


def check_json_messages(messages, limits: BodyLimits) -> None:
    """The limits on ``messages`` as the JSON body carried them (the request model names anything
    malformed afterwards)."""
    if not isinstance(messages, list):
        return
    num_parts = num_chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            num_chars += len(content)
        elif isinstance(content, list):
            num_parts += len(content)
            num_chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    check_counts(limits, num_messages=len(messages), num_parts=num_parts, num_chars=num_chars)


def check_counts(limits: BodyLimits, *, num_messages: int, num_parts: int, num_chars: int) -> None:
    """Messages, content parts and characters of text of one request, each against its limit."""
    for count, limit, what, name in ((num_messages, limits.max_messages, "messages", "max_messages"),
                                     (num_parts, limits.max_content_parts, "content parts", "max_content_parts"),
                                     (num_chars, limits.max_text_chars, "characters of text", "max_text_chars")):
        if count > limit:
            raise InvalidRequest(f"messages: {count} {what}; at most {limit} ({name})", param="messages")
