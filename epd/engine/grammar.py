"""Structured output: the tokens a request may sample are restricted, step by step, to those that
keep its output inside a grammar (a JSON schema, any JSON object, a regex, one of several choices,
or a Lark grammar), with llguidance (the grammar engine vLLM and SGLang also use). The mask is
applied by the sampler of whichever tier samples (prefill's first token, decode's others), after the
logits processors and before temperature; each tier keeps the request's own matcher and feeds it
every token the request has produced, so the split changes nothing.

Grammars are compiled against the model's tokenizer once per process (``GrammarCompiler``: building
llguidance's view of Qwen's 152k-token vocabulary takes about 1.5 s, so it happens at the first
structured request, not at start-up). A grammar that does not compile is refused when the request
arrives (``InvalidRequest``), never in a step where it would fail the batch.
"""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable

import numpy as np
import torch

from epd.errors import InvalidRequest
from epd.types import StructuredOutput

# JSON without free whitespace between tokens: a model (random weights included) cannot wander
# off into spaces and newlines and run out of max_tokens before the object closes
_JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar for ``structured``; a spec that is not even well-formed is a 400."""
    from llguidance import LLMatcher

    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(json.loads(spec), defaults=_JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError(f"choices must be a non-empty list of strings, got {spec[:80]}")
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
        # vLLM's grammars are EBNF ("root ::= ..."), as llama.cpp and xgrammar read them; llguidance reads Lark
        return LLMatcher.grammar_from_lark(gbnf_to_lark(spec) if "::=" in spec else spec)
    except ValueError as err:
        raise InvalidRequest(f"structured output ({kind}): {err}") from None


def gbnf_to_lark(grammar: str) -> str:
    """An EBNF grammar in llama.cpp's / xgrammar's form (``root ::= ...``), as Lark."""
    from llguidance.gbnf_to_lark import gbnf_to_lark as convert

    try:
        return convert(grammar)
    except Exception as err:  # noqa: BLE001 - the converter raises several types on bad input
        raise InvalidRequest(f"guided_grammar is not valid EBNF: {err}") from None


def check_grammar(structured: StructuredOutput) -> None:
    """Refuse a grammar llguidance cannot compile (no tokenizer needed: the router checks too)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(llguidance_grammar(structured))
    if error:
        raise InvalidRequest(f"structured output ({structured.kind}) does not compile: {error.strip()[:500]}")


class GrammarCompiler:
    """Matchers for one model's vocabulary; thread-safe. The tokenizer is loaded, and llguidance's
    view of it built, at the first grammar: most workers never see one, and a Qwen tokenizer costs
    over a second of CPU and a hundred MB to load."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int) -> None:
        self._load_tokenizer, self.vocab_size = load_tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def matcher(self, structured: StructuredOutput, output_token_ids=()):
        """A matcher in the state after ``output_token_ids`` (what the request produced already)."""
        from llguidance import LLMatcher

        grammar = llguidance_grammar(structured)
        matcher = LLMatcher(self.tokenizer_view(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"structured output ({structured.kind}) does not compile: {matcher.get_error()}")
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise InvalidRequest(f"the output so far does not match its structured output ({structured.kind}): "
                                 f"{matcher.get_error()}")
        return matcher

    def tokenizer_view(self):
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance.hf import from_tokenizer

                self._ll_tokenizer = from_tokenizer(self._load_tokenizer(), n_vocab=self.vocab_size)
            return self._ll_tokenizer


def apply_grammar_masks(logits: torch.Tensor, seqs, rows: list[int] | None = None) -> torch.Tensor:
    """Rows whose sequence has a matcher: every token the grammar does not allow next gets -inf.
    -> the masked logits (``logits`` itself when no row has a grammar). ``rows``: those rows, when
    the caller knows them."""
    if rows is None:
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = logits.shape[1]
    bitmask = allocate_token_bitmask(len(rows), vocab)
    for r, i in enumerate(rows):
        fill_next_token_bitmask(seqs[i].grammar, bitmask, r)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    allowed[~allowed.any(axis=1)] = True  # a matcher in error allows nothing: never sample from all -inf
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = out[index].masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
    return out


def advance_grammars(seqs, tokens: list[int], rows: list[int] | None = None) -> None:
    """After sampling: each matcher takes its sequence's new token (the mask allowed only these).
    ``rows``: the rows with a matcher, when the caller knows them."""
    for i in range(len(seqs)) if rows is None else rows:
        seq, token = seqs[i], tokens[i]
        if seq.grammar is not None and not seq.grammar.consume_token(token):
            seq.grammar_error = seq.grammar.get_error() or f"token {token} does not match the grammar"
