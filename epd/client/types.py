"""What the SDK returns: typed results built from the wire responses."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from epd.v1 import router_pb2


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of a generated token plus the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made; send it back in an assistant message's ``tool_calls``."""

    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ChatDelta:
    """New output of a streaming request. The last delta has ``finish_reason``."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # "stop" | "length" | "abort" on the last delta
    prompt_token_ids: list[int] | None = None  # first delta only
    num_cached_tokens: int = 0  # first delta only
    stop_reason: str | int | None = None  # last delta: the stop string or stop token id that ended it
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed with this delta
    index: int = 0  # which choice (a request with n > 1)

    @classmethod
    def from_proto(cls, msg: router_pb2.ChatGenerateResponse, *, is_first: bool) -> ChatDelta:
        return cls(request_id=msg.request_id, text=msg.text, token_ids=list(msg.token_ids),
                   logprobs=[TokenLogprob(lp.token_id, lp.logprob, dict(zip(lp.top_token_ids, lp.top_logprobs)))
                             for lp in msg.logprobs],
                   finish_reason=msg.finish_reason or None,
                   prompt_token_ids=list(msg.prompt_token_ids) if is_first else None,
                   num_cached_tokens=msg.num_cached_tokens if is_first else 0,
                   stop_reason=msg.stop_string or (msg.stop_token_id if msg.HasField("stop_token_id") else None),
                   tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls], index=msg.index)


@dataclass(frozen=True)
class ChatResult:
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob]
    num_cached_tokens: int
    usage: Usage
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS, length)
    tool_calls: list[ToolCall] = field(default_factory=list)  # with finish_reason "tool_calls"
    index: int = 0
    choices: list[ChatResult] = field(default_factory=list)  # every choice (n > 1), this one first


class _ChoiceBuilder:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.tool_calls: list[ToolCall] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def add(self, delta: ChatDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason
        self.tool_calls += delta.tool_calls


class ResultBuilder:
    """Folds a stream of deltas (of one choice, or of several by ``index``) into one ChatResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self._choices: dict[int, _ChoiceBuilder] = {}

    def add(self, delta: ChatDelta) -> None:
        self.request_id = delta.request_id or self.request_id
        self._choices.setdefault(delta.index, _ChoiceBuilder()).add(delta)
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
            self.num_cached_tokens = delta.num_cached_tokens

    def result(self) -> ChatResult:
        choices = [self._result(i, c) for i, c in sorted(self._choices.items())] or [self._result(0, _ChoiceBuilder())]
        completion = sum(len(c.token_ids) for c in choices)
        usage = Usage(prompt_tokens=len(self.prompt_token_ids), completion_tokens=completion,
                      cached_tokens=self.num_cached_tokens)
        return dataclasses.replace(choices[0], usage=usage, choices=choices)

    def _result(self, index: int, choice: _ChoiceBuilder) -> ChatResult:
        usage = Usage(prompt_tokens=len(self.prompt_token_ids), completion_tokens=len(choice.token_ids),
                      cached_tokens=self.num_cached_tokens)
        return ChatResult(request_id=self.request_id, text="".join(choice.texts), token_ids=choice.token_ids,
                          prompt_token_ids=self.prompt_token_ids, finish_reason=choice.finish_reason,
                          logprobs=choice.logprobs, num_cached_tokens=self.num_cached_tokens, usage=usage,
                          stop_reason=choice.stop_reason, tool_calls=choice.tool_calls, index=index)


@dataclass(frozen=True)
class WorkerHealth:
    tier: str
    address: str
    is_healthy: bool
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthStatus:
    status: str  # "ok" | "degraded"
    model: str
    workers: list[WorkerHealth]

    @property
    def is_ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_proto(cls, msg: router_pb2.RouterHealthResponse) -> HealthStatus:
        workers = [WorkerHealth(w.tier, w.address, w.healthy, dict(w.details)) for w in msg.workers]
        return cls(status=msg.status, model=msg.model, workers=workers)
