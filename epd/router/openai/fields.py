"""Every field of an OpenAI chat-completions request, and of vLLM's extensions to it, with what
this server does with it: it works, it is informational (accepted, used for nothing that changes
the output, as OpenAI documents it), or it is refused: a value that asks for something this server
does not do is a 400 naming the field, never a 200 that quietly did something else. A refused
field's default values (``presence_penalty: 0``, ``tools: []``, ``n: 1``...) are accepted, since
clients and agent frameworks send them unasked. A field in no list is logged once as ignored
(vLLM's rule for unknown fields).

``docs/openai-compat.md`` is this table (``python -m epd.router.openai.fields`` writes it; a test
checks that it did), so the documentation cannot drift from the code.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from epd.errors import InvalidRequest

log = logging.getLogger("epd.router.http")

Status = Literal["works", "informational", "refused"]


def _unset(value: Any) -> bool:
    return value is None


def _falsy(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _one_of(*defaults: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in defaults


@dataclass(frozen=True)
class FieldRule:
    name: str
    origin: Literal["OpenAI", "vLLM"]
    status: Status
    note: str
    asks_nothing: Callable[[Any], bool] = _unset  # values a refused field accepts (they ask for nothing)


def _works(name: str, note: str, origin: Literal["OpenAI", "vLLM"] = "OpenAI") -> FieldRule:
    return FieldRule(name, origin, "works", note)


def _info(name: str, note: str, origin: Literal["OpenAI", "vLLM"] = "OpenAI") -> FieldRule:
    return FieldRule(name, origin, "informational", note)


def _refused(name: str, note: str, asks_nothing: Callable[[Any], bool] = _unset,
             origin: Literal["OpenAI", "vLLM"] = "OpenAI") -> FieldRule:
    return FieldRule(name, origin, "refused", note, asks_nothing)


CHAT_FIELDS: tuple[FieldRule, ...] = (
    # ---- OpenAI
    _works("messages", "system / developer / user / assistant / tool roles; text and image_url parts; an "
                       "assistant's tool_calls and tool results are rendered back into the prompt"),
    _works("model", "one of the served names (--served-model-name), else 404; omitted: the first"),
    _works("max_tokens", "default: --default-max-tokens, else the checkpoint's max_new_tokens (generation_config.json), "
                         "else what --max-model-len leaves after the prompt (vLLM's)"),
    _works("max_completion_tokens", "OpenAI's newer name; wins over max_tokens"),
    _works("temperature", "[0, 2]; 0 is greedy; unset: the checkpoint's generation_config.json, else 1"),
    _works("top_p", "(0, 1]; unset: the checkpoint's generation_config.json, else 1"),
    _works("seed", "a 64-bit integer; the same seed draws the same tokens on any tier and batch"),
    _works("stop", "a string or up to any number of strings, cut from the answer; the tokens (and `usage`) end "
           "with the one that completed the match, however they were batched"),
    _works("stream", "server-sent events, OpenAI's chunk shape"),
    _works("stream_options", "include_usage; vLLM's continuous_usage_stats (usage on every chunk); another key "
                             "is a 400"),
    _works("logprobs", "log-probabilities of the model's own distribution"),
    _works("top_logprobs", "[0, 20]"),
    _works("n", "[1, 16] choices; the others start once the first has its first token, so they share its prefill "
                "(prefix cache) and its images' encoding; with a seed, choice i draws with seed + i"),
    _info("user", "an end-user id for abuse monitoring; not used for generation"),
    _info("metadata", "stored nowhere (there is no store); not used for generation"),
    _info("safety_identifier", "as user"),
    _info("prompt_cache_key", "prefix caching is automatic (block hashes), so no key is needed"),
    _refused("store", "this server stores no completions", _one_of(False)),
    _refused("service_tier", "one tier only", _one_of("auto", "default")),
    _works("presence_penalty", "[-2, 2]: minus this for every token already in the output"),
    _works("frequency_penalty", "[-2, 2]: minus this times the token's count in the output"),
    _works("logit_bias", "token id -> [-100, 100] added to its logit; an id past the vocabulary is a 400"),
    _works("response_format", "text, json_object, json_schema (client.chat.completions.parse works): the output "
                              "is kept inside the grammar token by token (llguidance), on every tier that samples"),
    _works("tools", "functions, rendered by the chat template (Qwen's Hermes format); calls come back as tool_calls"),
    _works("tool_choice", "none, auto, required, or a named function: required and named are held to a grammar, so "
                          "the call is always valid JSON for the tool's parameters"),
    _works("parallel_tool_calls", "false: one call at most with required or a named function"),
    _refused("functions", "deprecated by OpenAI for tools; not implemented", _falsy),
    _refused("function_call", "deprecated by OpenAI for tool_choice; not implemented", _one_of("none")),
    _refused("audio", "audio output is not supported"),
    _refused("modalities", "text output only", lambda v: v is None or v == ["text"]),
    _refused("prediction", "predicted outputs are not supported"),
    _refused("reasoning_effort", "not a reasoning model"),
    _refused("verbosity", "not supported"),
    _refused("web_search_options", "no web search"),
    # ---- vLLM's extensions
    _works("top_k", "-1 or 0: the whole vocabulary; unset: the checkpoint's generation_config.json, else -1", "vLLM"),
    _works("min_tokens", "EOS and stop tokens are held back until then", "vLLM"),
    _works("stop_token_ids", "", "vLLM"),
    _works("ignore_eos", "", "vLLM"),
    _works("return_token_ids", "prompt and completion token ids in the response", "vLLM"),
    _works("min_p", "[0, 1]: keep tokens of at least min_p x the top token's probability; unset: the checkpoint's "
                    "generation_config.json, else 0", "vLLM"),
    _works("repetition_penalty", "(0, 2]: over prompt and output tokens, as transformers and vLLM; unset: the "
                                 "checkpoint's generation_config.json, else 1", "vLLM"),
    _refused("length_penalty", "beam search only, which is not supported", _one_of(1, 1.0), "vLLM"),
    _refused("use_beam_search", "beam search is not supported", _one_of(False), "vLLM"),
    _refused("best_of", "not supported", _one_of(1), "vLLM"),
    _works("include_stop_str_in_output", "the matched stop string stays at the end of the text", "vLLM"),
    _refused("skip_special_tokens", "special tokens are always skipped", _one_of(True), "vLLM"),
    _refused("spaces_between_special_tokens", "not supported", _one_of(True), "vLLM"),
    _refused("truncate_prompt_tokens", "prompts are never truncated: a prompt too long is a 400", origin="vLLM"),
    _refused("prompt_logprobs", "not supported", origin="vLLM"),
    _refused("echo", "not supported", _one_of(False), "vLLM"),
    _refused("add_generation_prompt", "the generation prompt is always added", _one_of(True), "vLLM"),
    _refused("continue_final_message", "not supported", _one_of(False), "vLLM"),
    _refused("add_special_tokens", "not supported", _one_of(False), "vLLM"),
    _refused("documents", "not supported", _falsy, "vLLM"),
    _refused("chat_template", "a per-request template is not taken (a client could reshape the prompt); the server's "
                              "is --chat-template", origin="vLLM"),
    _works("chat_template_kwargs", "the template's own variables (add_vision_id for Qwen-VL's); the server's "
                                   "arguments (messages, tools, add_generation_prompt, ...) are a 400", "vLLM"),
    _works("mm_processor_kwargs", "min_pixels / max_pixels of this request's images (the encoder resizes by them; "
                                  "another value is another encoder-cache entry); within the checkpoint's "
                                  "max_pixels; other keys a 400", "vLLM"),
    _works("structured_outputs", "one of json (a schema), regex, choice, grammar (EBNF or Lark), json_object", "vLLM"),
    _works("guided_json", "as structured_outputs.json", "vLLM"),
    _works("guided_regex", "as structured_outputs.regex", "vLLM"),
    _works("guided_choice", "as structured_outputs.choice", "vLLM"),
    _works("guided_grammar", "as structured_outputs.grammar", "vLLM"),
    _works("guided_decoding_backend", "auto, guidance or llguidance (the one this server runs); others a 400", "vLLM"),
    _refused("guided_whitespace_pattern", "JSON is generated without free whitespace", origin="vLLM"),
    _refused("priority", "requests are served in arrival order", _one_of(0), "vLLM"),
    _works("request_id", "the response id's base (chatcmpl-<id>), as the X-Request-Id header, which wins", "vLLM"),
    _refused("return_tokens_as_token_ids", "not supported", _one_of(False), "vLLM"),
    _refused("cache_salt", "not supported", origin="vLLM"),
    _refused("kv_transfer_params", "KV transfer is the cluster's own", origin="vLLM"),
    _refused("vllm_xargs", "not supported", _falsy, "vLLM"),
    _refused("bad_words", "not supported", _falsy, "vLLM"),
    _refused("allowed_token_ids", "not supported", origin="vLLM"),
    _refused("logits_processors", "not supported", _falsy, "vLLM"),
)
RULES: dict[str, FieldRule] = {rule.name: rule for rule in CHAT_FIELDS}
_logged_unknown: set[str] = set()


def check_chat_fields(body: Mapping[str, Any]) -> None:
    """400 for the first refused field that asks for something; unknown fields logged once each."""
    for name, value in body.items():
        rule = RULES.get(name)
        if rule is None:
            if name not in _logged_unknown and len(_logged_unknown) < 1024:
                _logged_unknown.add(name)
                log.warning("chat completions: ignoring the unknown request field %r", name)
            continue
        if rule.status == "refused" and not rule.asks_nothing(value):
            raise InvalidRequest(f"{name} is not supported by this server: {rule.note} (got {_short(value)})",
                                 param=name)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def markdown_table() -> str:
    """The table docs/openai-compat.md carries."""
    lines = ["| field | from | here | notes |", "|---|---|---|---|"]
    for rule in CHAT_FIELDS:
        status = {"works": "works", "informational": "accepted, informational", "refused": "refused (400)"}[rule.status]
        lines.append(f"| `{rule.name}` | {rule.origin} | {status} | {rule.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
