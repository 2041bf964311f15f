"""The parts of the nccl and cuda_ipc transports that need no GPU: id encoding and clear refusals."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from epd.transport import TensorStore, TransportError
from epd.transport.nccl import _nccl, unique_id_from_bytes, unique_id_to_bytes


def test_unique_id_survives_the_wire():
    unique_id = tuple(range(-128, 0))  # cupy hands out signed C chars
    data = unique_id_to_bytes(unique_id)
    assert len(data) == 128 and unique_id_from_bytes(data) == unique_id


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_missing_cupy_names_the_extra():
    with pytest.raises(TransportError, match=r"needs cupy with NCCL .*; run pip install 'epd\[cuda1[23]\]'"):
        _nccl()


@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_gpu_transports_refuse_cpu_tensors(clock, transport):
    with TensorStore(clock=clock, address="127.0.0.1:1") as store:
        with pytest.raises(TransportError, match=f"{transport} exports CUDA tensors; got one on cpu"):
            store.export(torch.zeros(3), transport=transport, ttl_s=10)
