"""The plain types every layer shares: what a request asks for (``SamplingParams``, ``ChatRequest``),
what comes back (``TokenLogprobs``, ``StreamEvent``, ``RequestOutput``). No torch, no proto: the
engine, the router, the SDK and the front ends all import these, and wire types are converted to
and from them at each process edge (``epd.wire.protocol``)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives a request may ask for, per token


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (``epd.engine.grammar`` enforces it). ``spec``: the JSON
    schema (as JSON text), the regex, the choices (a JSON list of strings) or the Lark grammar;
    empty for ``json_object``."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            from epd.errors import InvalidRequest
            raise InvalidRequest(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got "
                                 f"{self.kind!r}")


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
    # logits processors, in vLLM's order: logit_bias, then the penalties, then temperature and the
    # filters (top-k, top-p, min-p); logprobs stay those of the raw distribution
    presence_penalty: float = 0.0  # minus this for every token already in the output (OpenAI)
    frequency_penalty: float = 0.0  # minus this times its count in the output (OpenAI)
    repetition_penalty: float = 1.0  # a token in the prompt or output: positive logits / p, others * p
    min_p: float = 0.0  # keep tokens of at least min_p x the top token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    structured: StructuredOutput | None = None  # a grammar the output must match (masked per step)

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"in [0, max_tokens={self.max_tokens}]",
               self.min_tokens)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 or >= 1", self.top_k)
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"None or in [0, {MAX_LOGPROBS}]", self.logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, "in [-2, 2]", value)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "in (0, 2]", self.repetition_penalty)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        for token_id, bias in self.logit_bias:
            _check(token_id >= 0 and -100.0 <= bias <= 100.0, "logit_bias",
                   "token ids >= 0 with biases in [-100, 100]", (token_id, bias))

    @property
    def has_logits_processors(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        from epd.errors import InvalidRequest
        raise InvalidRequest(f"SamplingParams.{name} must be {expected}, got {got!r}", param=name)


@dataclass(frozen=True)
class MultimodalItemSpan:
    """Where one multimodal item sits in a prompt and what identifies its content: what the block
    manager hashes into KV-prefix keys and what a sequence's layout is built from."""

    offset: int  # first placeholder position in the prompt
    length: int  # placeholder span == embedding rows (Qwen-VL has no special tokens inside a span)
    mm_hash: str = ""  # content hash of the item (bytes + processor kwargs + model id)
    grid_thw: tuple[int, ...] = ()  # the item's patch grid (temporal, height, width)
    # a video's seconds per temporal patch (Qwen2.5-VL spaces temporal M-RoPE positions by it); 0: an image
    second_per_grid_t: float = 0.0
    # where each temporal patch's placeholders start when text separates them (Qwen3-VL puts a
    # timestamp before each); empty: one contiguous span. Rows stay in order, split evenly.
    segment_offsets: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """One past the item's last placeholder (text between segments included)."""
        if self.segment_offsets:
            return self.segment_offsets[-1] + self.length // len(self.segment_offsets)
        return self.offset + self.length


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token plus the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made (``epd.router.tool_calls`` parses it out of its text)."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")


MAX_TOKENS_TO_FILL = 2**31 - 1  # sampling.max_tokens of a ChatRequest with fill_max_tokens, until it is set


@dataclass
class ChatRequest:
    """One chat completion as both front ends hand it to the router's pipeline. ``messages`` are
    OpenAI-style: content is a string or a list of parts ``{"type": "text", "text": ...}`` /
    ``{"type": "image_url", "image_url": {"url": ...}}`` / ``{"type": "image", "image": bytes | url}``.
    Media are resolved by the pipeline, never by a front end."""

    messages: list[dict]
    sampling: SamplingParams
    request_id: str
    stop_strings: list[str] = field(default_factory=list)  # the output ends before the first match
    timeout_s: float | None = None  # per-request deadline; None: the router's default
    include_stop_str_in_output: bool = False  # keep a matched stop string in the text (vLLM's)
    tools: list[dict] | None = None  # rendered by the chat template (None: no tools in the prompt)
    prompt: str | list[int] | None = None  # a raw prompt (/v1/completions): no chat template, no images
    chat_template_kwargs: dict | None = None  # the chat template's own variables (vLLM's chat_template_kwargs)
    # the image processor's min_pixels / max_pixels for this request's images (vLLM's mm_processor_kwargs)
    mm_processor_kwargs: dict | None = None
    n: int = 1  # choices of this one prompt
    parse_tool_calls: bool = False  # turn <tool_call> blocks of the output into tool calls
    # no max_tokens was given: the pipeline sets it to what the model length leaves after the prompt
    # (vLLM's default), once the prompt is tokenized; until then sampling.max_tokens is a placeholder
    fill_max_tokens: bool = False


@dataclass
class StreamEvent:
    """New output of one request. The first event also carries the prompt."""

    token_ids: list[int]
    text: str  # the detokenized text of exactly these tokens (incremental, UTF-8 safe, stop strings applied)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    prompt_token_ids: list[int] | None = None  # first event only
    num_cached_tokens: int = 0  # first event only: prompt tokens served from the prefix cache
    # last event, finish "stop": the stop string or stop token id that ended it (None: EOS), vLLM's
    stop_reason: str | int | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls completed with this event
    index: int = 0  # which choice (a request with n > 1)


@dataclass
class RequestOutput:
    """A finished request, as ``epd.LLM`` and the router's blocking wrapper return it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
