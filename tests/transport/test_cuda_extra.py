"""GPU transport plumbing that is testable without a GPU: the nccl error names the extra that fits
torch's CUDA (cupy wheels are per CUDA major: a cuda12 cupy beside a CUDA-13 torch would load two CUDA
runtimes), and a cuda_ipc handle names its GPU by UUID."""
from __future__ import annotations

import pytest
import torch

from epd.transport.nccl import cuda_extra_hint


@pytest.mark.parametrize("cuda, expected", [
    ("12.8", "pip install 'epd[cuda12]'"), ("13.0", "pip install 'epd[cuda13]'"),
    (None, "pip install 'epd[cuda12]' or 'epd[cuda13]', the one matching torch's CUDA")])
def test_the_hint_follows_torchs_cuda(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert cuda_extra_hint() == expected


def test_a_cuda_ipc_handle_finds_its_gpu_by_uuid_whatever_the_ordinals(monkeypatch):
    """A producer seeing GPUs [a, b] exports from its cuda:1 (b); a consumer started with
    CUDA_VISIBLE_DEVICES=b sees b as its cuda:0."""
    from types import SimpleNamespace

    from epd.transport.cuda_ipc import local_ordinal
    from epd.transport.handles import TransportError
    visible = ["GPU-b"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=visible[i]))
    assert local_ordinal(1, "GPU-b") == 0
    assert local_ordinal(1, "") == 1  # a handle from before UUIDs: the producer's ordinal, as it was
    with pytest.raises(TransportError, match="the producer's GPU GPU-a is not visible in this process"):
        local_ordinal(0, "GPU-a")
