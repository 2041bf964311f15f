"""LLM building blocks shared by model families. Packed layers load their checkpoint shards
themselves, so tensors stored separately (q/k/v, gate/up) land in one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class skipping_init(TorchFunctionMode):
    """``with torch.device("meta"), skipping_init(): model = Model(cfg)``: the layers' own random
    init (``torch.nn.init.*`` in their ``reset_parameters``) is not run; every weight is loaded from
    the checkpoint afterwards. Why: on meta tensors that init runs torch's Python reference kernels,
    whose first call imports torch._dynamo, about a second of every worker's start for numbers
    nobody reads. A torch function mode, so it holds for this thread only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded)


class PackedLinear(nn.Linear):
    """One matmul over several checkpoint projections stacked on the output dim
    (q|k|v or gate|up): fewer, larger GEMMs are what make small-batch decode fast."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard_id: int) -> None:
        """Copy one checkpoint projection (``param_name`` is "weight" or "bias") into its rows."""
        offset, size = self.shard_offsets[shard_id], self.shard_sizes[shard_id]
        target = getattr(self, param_name).data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard_id}: checkpoint tensor {tuple(loaded.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 like the reference, then cast back, so bf16 runs match transformers too
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE (Qwen2-VL): positions are (temporal, height, width) triples; the rotary
    frequency bands are split by ``mrope_section`` and band i reads component i % 3.
    Text tokens carry three equal components, which reduces to ordinary 1-D RoPE."""

    def __init__(self, head_dim: int, rope_theta: float, mrope_section: list[int]) -> None:
        super().__init__()
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2={head_dim // 2}")
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.mrope_section = list(mrope_section)

    def _inv_freq(self) -> torch.Tensor:
        # computed on the CPU even inside a ``torch.device("meta")`` block: arithmetic on meta
        # tensors runs torch's Python reference kernels (see ``skipping_init``)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device="cpu") / self.head_dim
        return 1.0 / (self.rope_theta ** exponents)

    def reset_buffers(self) -> None:
        """Recompute after materialising a model built on the meta device."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(torch.bfloat16)`` would round the frequencies to 8 bits of mantissa: at position
        # 3,000 the angle is then off by whole radians. They stay float32 wherever the model goes.
        super()._apply(fn, recurse)
        self.reset_buffers()
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] int64 -> cos, sin: [T, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, head_dim/2]
        cos, sin = self._recompose(freqs.cos()), self._recompose(freqs.sin())
        return cos.to(dtype), sin.to(dtype)

    def _recompose(self, freq: torch.Tensor) -> torch.Tensor:
        bands = freq.split(self.mrope_section, dim=-1)
        half = torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)
        return torch.cat((half, half), dim=-1)


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """Qwen3-VL's M-RoPE: the bands interleave instead of following each other. Rotary pair i
    reads the height component when i % 3 == 1 and i < 3 * sections[1], the width component when
    i % 3 == 2 and i < 3 * sections[2], else the temporal one (transformers' recomposition)."""

    def _recompose(self, freq: torch.Tensor) -> torch.Tensor:
        half = freq[0].clone()
        for component, offset in ((1, 1), (2, 2)):
            band = slice(offset, self.mrope_section[component] * 3, 3)
            half[..., band] = freq[component, ..., band]
        return torch.cat((half, half), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin



def to_keeping_float32_buffers(module: nn.Module, *, device, dtype: torch.dtype,
                               suffixes: tuple[str, ...] = ("inv_freq",)) -> nn.Module:
    """``module.to(device, dtype)`` with its rotary frequency buffers left in float32 (on the new
    device): transformers' vision towers keep them so when loaded in bf16, and a bf16 rounding of
    them moves every rotary angle."""
    saved = {name: buf.detach().clone() for name, buf in module.named_buffers() if name.endswith(suffixes)}
    module.to(device=device, dtype=dtype)
    for name, value in saved.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attr, value.to(device=getattr(owner, attr).device, dtype=torch.float32))
    return module
