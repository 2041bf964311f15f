"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature/top-k/top-p), which is what OpenAI-compatible servers report.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch

from epd.engine.grammar import advance_grammars, apply_grammar_masks
from epd.engine.logits_processors import apply_logits_processors, keep_min_p
from epd.engine.sequence import Sequence
from epd.types import TokenLogprobs


class Sampler:
    def __init__(self) -> None:
        self._seeded = torch.Generator()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        """logits: [B, V] (one row per sequence that samples this step) -> (token, logprobs) per row."""
        tokens, logprobs = self.sample(logits, seqs, SampleRows(seqs))
        out: list[tuple[int, TokenLogprobs | None]] = [(token, None) for token in tokens]
        for i, row_logprobs in logprobs.items():
            out[i] = (tokens[i], row_logprobs)
        return out

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], rows: SampleRows
               ) -> tuple[list[int], dict[int, TokenLogprobs | None]]:
        """``rows``: ``seqs`` sorted by what they need (a batch kept from step to step keeps them)
        -> (each row's token, the logprobs of the rows that asked for them, by row)."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        logits = logits.float()
        processed = apply_logits_processors(logits, seqs, rows.processed)  # bias and penalties; logprobs stay raw
        processed = apply_grammar_masks(processed, seqs, rows.grammars)  # structured output: what may come next
        if rows.greedy_only:  # the common batch: one argmax, already in order
            tokens = greedy_tokens(processed).tolist()
        else:
            tokens = [None] * len(seqs)
            self._sample_batched(processed, seqs, tokens, rows)
            for i in [i for i, token in enumerate(tokens) if token is None]:  # seeded: each from its own generator
                tokens[i] = self._sample_one(processed[i], seqs[i])
        advance_grammars(seqs, tokens, rows.grammars)
        # rows are indexed only where logprobs are asked for
        return tokens, {i: self._logprobs(logits[i], tokens[i], seqs[i]) for i in rows.logprobs}

    def on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """The step's tokens as one int64 tensor on the logits' device, with no host sync (async
        scheduling keeps them there while the next step is launched) -> None where a row needs the
        host: a grammar, logits processors, logprobs or a seeded draw (``__call__`` samples those)."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        rows = SampleRows(seqs)
        if rows.processed or rows.grammars or rows.logprobs or rows.num_batched != len(seqs):
            return None
        picks = self._picks(logits.float(), seqs, rows)
        if sum(len(indices) for indices, _ in picks) != len(seqs):  # min-p rows beside FlashInfer's kernel
            return None
        if len(picks) == 1:  # every row alike (all greedy, the common batch): already in order
            return picks[0][1].to(logits.device)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for indices, picked in picks:
            tokens[torch.tensor(indices, device=logits.device)] = picked.to(logits.device)
        return tokens

    @classmethod
    def _sample_batched(cls, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int | None],
                        rows: SampleRows) -> None:
        for indices, picked in cls._picks(logits, seqs, rows):
            for i, token in zip(indices, picked.tolist()):
                tokens[i] = token

    @staticmethod
    def _picks(logits: torch.Tensor, seqs: list[Sequence], rows: SampleRows) -> list[tuple[list[int], torch.Tensor]]:
        """Greedy rows in one argmax, unseeded plain-temperature rows in one softmax and one draw,
        unseeded top-k / top-p rows in one top-k (or sort) and one draw: row by row, sampling a large
        batch over a large vocabulary costs more than the model's decode step itself, and on a GPU
        each row's draw would be a sync. Seeded rows stay per row (their draws are fixed per token).
        -> (row indices, their tokens as a tensor) per group."""
        greedy, plain, filtered = rows.greedy, rows.plain, rows.filtered
        picks = []
        if greedy:
            picks.append((greedy, greedy_tokens(_rows(logits, greedy))))
        if logits.is_cuda and (kernels := flashinfer_sampling()) is not None:
            sampled = _sample_with_flashinfer(kernels, logits, seqs)
            return picks + ([sampled] if sampled is not None else [])
        if plain:
            values = [seqs[i].sampling_params.temperature for i in plain]
            scaled = _rows(logits, plain)
            if any(t != 1.0 for t in values):  # the API's default 1 divides by nothing: no [B, vocab] copy
                scaled = scaled / torch.tensor(values, device=logits.device).unsqueeze(1)
            picks.append((plain, draw(torch.softmax(scaled, dim=-1))))
        if filtered:  # unseeded top-k / top-p rows: one sort (or top-k) and one draw for all of them
            probs, candidates = filtered_probs([seqs[i].sampling_params for i in filtered], _rows(logits, filtered))
            picked = draw(probs)
            picks.append((filtered, candidates.gather(1, picked[:, None]).squeeze(1)))
        return picks

    def _sample_one(self, row: torch.Tensor, seq: Sequence) -> int:
        """A seeded row: its draw comes from its own (seed, token index) generator."""
        params = seq.sampling_params
        if params.is_greedy:
            return int(row.argmax())
        scaled = row / params.temperature
        if params.top_k > 0:
            scaled = _keep_top_k(scaled, params.top_k)
        if params.top_p < 1.0:
            scaled = _keep_top_p(scaled, params.top_p)
        probs = torch.softmax(scaled, dim=-1)
        if params.min_p > 0.0:
            probs = keep_min_p(probs[None], torch.tensor([params.min_p], device=probs.device))[0]
        generator = self._generator(seq)
        if generator is not None:  # seeded draws come from a CPU generator: the same token on any device
            probs = probs.cpu()
        return int(torch.multinomial(probs, 1, generator=generator))

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded request draws output token k from seed (seed, k): its draws depend neither on
        the batch nor on which process samples it, so prefill (token 0) and decode (the rest) on
        different workers reproduce the in-process result."""
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        return self._seeded.manual_seed((seed * 1_000_003 + seq.num_output_tokens) % (2**63))

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, seq: Sequence) -> TokenLogprobs | None:
        k = seq.sampling_params.logprobs
        if k is None:
            return None
        logp = torch.log_softmax(row, dim=-1)
        top = {}
        if k > 0:
            values, ids = logp.topk(k)
            top = {int(i): float(v) for i, v in zip(ids, values)}
        return TokenLogprobs(token_id=token, logprob=float(logp[token]), top=top)


@cache
def flashinfer_sampling():
    """FlashInfer's sampling kernels where it is installed (the ``gpu`` extra), else None."""
    try:
        from flashinfer import sampling
    except ImportError:
        return None
    return sampling


def _sample_with_flashinfer(kernels, logits: torch.Tensor, seqs: list[Sequence]
                            ) -> tuple[list[int], torch.Tensor] | None:
    """Unseeded sampled rows on CUDA in one FlashInfer kernel: temperature, then top-k, then top-p
    (``top_k_first``: the order the row-by-row filters apply them), sampled by rejection on the
    device with no sort of the vocabulary and no host sync per row -> (rows, tokens), or None."""
    rows = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy and seq.sampling_params.seed is None
            and not seq.sampling_params.min_p]  # min-p rows: the torch path (no single kernel does all four)
    if not rows:
        return None
    params = [seqs[i].sampling_params for i in rows]
    vocab, device = logits.shape[1], logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.int32, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    picked = kernels.top_k_top_p_sampling_from_logits(_rows(logits, rows) / temperatures, top_k, top_p,
                                                       filter_apply_order="top_k_first")
    return rows, picked


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row (``argmax``'s rule, and transformers'). On the CPU torch's
    ``argmax`` over a 152k vocabulary is the slow reduction (3.2 ms at batch 32 here, against 1.2 ms
    for ``max`` and 0.7 ms for numpy's ``argmax``, each returning the first maximum too)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def _rows(logits: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``logits[indices]`` without copying the batch's [B, vocab] logits when it is all of them
    (a whole-batch copy by advanced indexing cost more than the argmax at batch 32), and with the
    faster ``index_select`` when it is not."""
    if len(indices) == logits.shape[0]:
        return logits
    return logits.index_select(0, torch.tensor(indices, device=logits.device))


_DRAW_BLOCK = 64  # columns per block of the two-level draw


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One column per row of ``probs`` (non-negative, each row at any scale) by inverse-CDF
    sampling: the first column whose cumulative weight passes a uniform draw. In two levels on a
    wide row: the block of 64 columns the draw lands in (a cumulative sum over the blocks' totals),
    then the column inside that block. A cumulative sum along a whole row is a sequential scan:
    at 256 rows of 2,048 it cost more than the softmax before it (0.50 against 0.30 ms here), and a
    real vocabulary is 75x wider; block totals are a plain reduction. Both levels are exact
    inverse-CDF steps, so the tokens follow the same distribution (a zero-weight column is never
    drawn); on CPU this is also ~3x faster than ``torch.multinomial``, whose exponential draws
    dominate."""
    rows, width = probs.shape
    if width <= 4 * _DRAW_BLOCK:
        return _draw_from_cdf(probs.cumsum(dim=-1))
    if width % _DRAW_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, -width % _DRAW_BLOCK))  # zero weight: never drawn
    blocks = probs.view(rows, -1, _DRAW_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum_(dim=-1)
    u = torch.rand(rows, 1, dtype=probs.dtype, device=probs.device) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, u, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = block_cdf.gather(1, (block - 1).clamp_(min=0)).masked_fill_(block == 0, 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(-1, -1, _DRAW_BLOCK)).squeeze(1).cumsum_(dim=-1)
    # the block's own sum may round differently from its cumulative one: stay inside the block
    rest = torch.minimum(u - before, inner[:, -1:] * (1.0 - 2.0 ** -20))
    column = torch.searchsorted(inner, rest, right=True).clamp_(max=_DRAW_BLOCK - 1)
    # a row with no weight at all (zero, or NaN from its logits) lands in the padding: keep it a column
    return (block * _DRAW_BLOCK + column).squeeze(1).clamp_(max=width - 1)


def _draw_from_cdf(cdf: torch.Tensor) -> torch.Tensor:
    """The first column whose cumulative weight passes a uniform draw, scaled by each row's total
    (so the cumulative sum's rounding cannot push it past the last column)."""
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1).squeeze(1)


def filtered_probs(params: list, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' temperature-scaled distributions restricted by their top-k, then renormalised and
    restricted by their top-p, computed for the whole batch at once: -> (probs, token ids), both
    [R, C] over each row's C best candidates, best first (0 where a row's filters drop one).
    The same distribution ``_keep_top_k`` then ``_keep_top_p`` give one row at a time."""
    vocab = logits.shape[1]
    device = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    temperatures = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    width = int(top_k.max())  # every row's candidates are among the widest top-k (all: a full sort)
    scaled = logits / temperatures[:, None]
    values, candidates = scaled.topk(width, dim=-1) if width < vocab else scaled.sort(dim=-1, descending=True)
    rank = torch.arange(width, device=device)[None, :]
    values = values.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # drop a candidate when the mass before it already reaches p; the best one always stays
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    if any(p.min_p > 0 for p in params):  # asked of the parameters: asking the tensor would sync a GPU
        probs = keep_min_p(probs, torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype))
    return probs / probs.sum(dim=-1, keepdim=True), candidates


_GREEDY, _PLAIN, _FILTERED, _SEEDED = "greedy", "plain", "filtered", "seeded"
_ONLY_GREEDY = (_GREEDY, False, False)  # the common row: the maximum, nothing else to do


class SampleRows:
    """A step's rows sorted by what they need, in one pass over the batch (a pass per question was
    a visible share of a large decode batch's step). What a sequence needs never changes: its
    kind, logits processors and logprobs are read once (``_needs``), and a batch whose sequences
    stay the same keeps this from step to step."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.greedy, self.plain, self.filtered = [], [], []
        self.processed, self.grammars, self.logprobs = [], [], []
        by_kind = {_GREEDY: self.greedy, _PLAIN: self.plain, _FILTERED: self.filtered}
        self.size = len(seqs)
        for i, seq in enumerate(seqs):
            needs = seq.sample_needs or _needs(seq)
            if needs is _ONLY_GREEDY:
                self.greedy.append(i)
            else:
                kind, processed, logprobs = needs
                if kind is not _SEEDED:
                    by_kind[kind].append(i)
                if processed:
                    self.processed.append(i)
                if logprobs:
                    self.logprobs.append(i)
            if seq.grammar is not None:
                self.grammars.append(i)

    _GROUPS = ("greedy", "plain", "filtered", "processed", "grammars", "logprobs")

    def kept(self, keep: np.ndarray) -> SampleRows:
        """The same rows less those ``keep`` (bool, one per row) drops, renumbered: no sequence read."""
        renumbered = np.cumsum(keep) - 1
        out = SampleRows([])
        out.size = int(renumbered[-1]) + 1 if len(keep) else 0
        for name in self._GROUPS:
            if rows := getattr(self, name):
                rows = np.asarray(rows)
                setattr(out, name, renumbered[rows[keep[rows]]].tolist())
        return out

    def joined(self, seqs: list[Sequence]) -> SampleRows:
        """These rows, then one for each of ``seqs``."""
        new = SampleRows(seqs)
        for name in self._GROUPS:
            setattr(new, name, getattr(self, name) + [self.size + i for i in getattr(new, name)])
        new.size += self.size
        return new

    @property
    def greedy_only(self) -> bool:
        return len(self.greedy) == self.size

    @property
    def num_batched(self) -> int:
        """Rows drawn for the whole batch at once (the rest are seeded: drawn one by one)."""
        return len(self.greedy) + len(self.plain) + len(self.filtered)


def _needs(seq: Sequence) -> tuple[str, bool, bool]:
    params = seq.sampling_params
    needs = (sample_kind(seq), params.has_logits_processors, params.logprobs is not None)
    seq.sample_needs = _ONLY_GREEDY if needs == _ONLY_GREEDY else needs
    return seq.sample_needs


def sample_kind(seq: Sequence) -> str:
    """How a sequence's rows are drawn: greedy (seeded or not: the maximum), plain (unseeded, the
    temperature-scaled distribution alone), filtered (unseeded, with top-k / top-p / min-p), or
    seeded (row by row). Worked out once per sequence: its parameters never change."""
    kind = seq.sample_kind
    if kind is None:
        kind = seq.sample_kind = _classify(seq.sampling_params)
    return kind


def _classify(params) -> str:
    if params.is_greedy:
        return _GREEDY
    if params.seed is not None:
        return _SEEDED
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        return _FILTERED
    return _PLAIN


def _keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    threshold = logits.topk(k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    sorted_logits, order = logits.sort(descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # drop a token when the mass before it already reaches p; the top token always stays
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
