"""The GPU transports' error names the extra that fits this torch's CUDA (cupy wheels are per CUDA
major: a cuda12 cupy beside a CUDA-13 torch would load two CUDA runtimes)."""
from __future__ import annotations

import pytest
import torch

from epd.transport.nccl import cuda_extra_hint


@pytest.mark.parametrize("cuda, expected", [("12.8", "epd[cuda12]"), ("13.0", "epd[cuda13]"),
                                            (None, "epd[cuda12 or cuda13, after your torch's CUDA]")])
def test_the_hint_follows_torchs_cuda(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert cuda_extra_hint() == f"pip install '{expected}'"
