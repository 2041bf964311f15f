"""What a request does to the logits before anything is sampled from them, in vLLM's order:
``logit_bias`` (OpenAI), then the repetition penalty (over prompt and output tokens, as in
transformers and vLLM) and the presence / frequency penalties (over output tokens, OpenAI's
definition), then the sampler's temperature and filters; ``min_p`` is one of those filters
(``keep_min_p``). Every tier that samples (prefill's first token, decode's others) runs the same
code over the same token ids, so the split changes nothing.

Rows without processors are not copied; the processed rows are computed together: one scatter of
their token counts, not a loop over the vocabulary.
"""
from __future__ import annotations

import torch

from epd.engine.sequence import Sequence


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence], rows: list[int] | None = None
                            ) -> torch.Tensor:
    """[B, V] logits -> the logits the sampler draws from (``logits`` itself when no row asks).
    ``rows``: the rows that ask, when the caller knows them."""
    if rows is None:
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.has_logits_processors]
    if not rows:
        return logits
    out = logits.clone()
    sub = out[rows]
    params = [seqs[i].sampling_params for i in rows]
    device = logits.device
    _add_logit_bias(sub, params)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _token_counts(sub.shape, [seqs[i].token_ids for i in rows], device) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=sub.dtype)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = _token_counts(sub.shape, [seqs[i].token_ids[seqs[i].num_prompt_tokens:] for i in rows], device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=sub.dtype)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device, dtype=sub.dtype)[:, None]
        sub = sub - frequency * counts - presence * (counts > 0)
    out[rows] = sub
    return out


def keep_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below ``min_p`` x their row's most likely token's
    ([R, C] probabilities, [R] thresholds); the top token always stays. Not renormalised."""
    top = probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < min_p[:, None] * top, 0.0)


def _add_logit_bias(sub: torch.Tensor, params) -> None:
    vocab = sub.shape[1]
    rows, ids, biases = [], [], []
    for r, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            if token_id >= vocab:
                raise ValueError(f"logit_bias names token {token_id}; the vocabulary has {vocab}")
            rows.append(r)
            ids.append(token_id)
            biases.append(bias)
    if rows:
        sub.index_put_((torch.tensor(rows, device=sub.device), torch.tensor(ids, device=sub.device)),
                       torch.tensor(biases, device=sub.device, dtype=sub.dtype), accumulate=True)


def _token_counts(shape: torch.Size, token_lists: list[list[int]], device) -> torch.Tensor:
    """[R, V] how often each token occurs in each row's list."""
    counts = torch.zeros(shape, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if sum(lengths):
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor(lengths)).to(device)
        ids = torch.tensor([t for tokens in token_lists for t in tokens], device=device)
        counts.index_put_((rows, ids), torch.ones(len(ids), device=device), accumulate=True)
    return counts
