"""The zero-cost language model: the engine around it is real (scheduler, block tables, KV cache of
the configured size, prefill's KV export and decode's import, the sampler and its bookkeeping); its
forward does no arithmetic.

Tokens come from fixed logits: one per position, from a small logit vocabulary of real tokens, so
the text detokenizes to words, the same prompt always gives the same tokens (greedy or sampled: the
chosen token's logit is far above the rest), and nothing ends early (EOS has no logit: a request
runs to max_tokens, as a benchmark wants).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

_FAR_BELOW = -1.0e4  # every other token's logit: a probability of ~0 at any temperature


@dataclass(frozen=True)
class NullTextConfig:
    """What the engine reads of a model's config; the KV cache is sized from it, so a handle has a
    real model's size while nothing is computed."""

    vocab_size: int  # the logit vocabulary (the sampler's width)
    hidden_size: int  # the width of an embedding row (encoder output, prefill input)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    first_token_id: int  # tokens are drawn from [first_token_id, vocab_size): whole BPE pieces, no bare bytes
    embedding_vocab_size: int  # the tokenizer's: every prompt id is "in vocabulary"
    step_ms: float = 0.0  # each forward's wall time, spent asleep (a device's step; no CPU)


class NullEmbedding(nn.Module):
    """Rows of the hidden width for any ids, left as allocated (no table: a real one of this width
    would be GBs)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("_device", torch.empty(0), persistent=False)  # follows .to(device, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # no arithmetic and no memset: only column 0, which the forward overwrites, is ever read
        return torch.empty(input_ids.shape[0], self.embedding_dim, dtype=self._device.dtype,
                           device=self._device.device)


class NullLLM(nn.Module):
    """``forward`` passes the fused inputs through with each token's position in column 0;
    ``compute_logits`` turns that position into the one token it names."""

    deepstack_levels = 0

    def __init__(self, cfg: NullTextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = NullEmbedding(cfg.embedding_vocab_size, cfg.hidden_size)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_cache, meta, backend,
                deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
        """inputs_embeds [T, D], positions [3, T] -> [T, D]; nothing reads or writes the KV cache."""
        inputs_embeds[:, 0] = positions[0].to(inputs_embeds.dtype)
        if self.config.step_ms:  # the host waits as it would on a device's kernels: idle, not computing
            time.sleep(self.config.step_ms / 1000)
        return inputs_embeds

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, vocab]: 0 at the token of the row's position, far below everywhere else."""
        first, vocab = self.config.first_token_id, self.config.vocab_size
        choice = first + (hidden[:, 0].long() * 7919) % (vocab - first)
        logits = torch.full((hidden.shape[0], vocab), _FAR_BELOW, dtype=torch.float32,
                            device=hidden.device)
        return logits.scatter_(1, choice[:, None], 0.0)
