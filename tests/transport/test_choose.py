from __future__ import annotations

import pytest

from epd.transport import choose_transport


@pytest.mark.parametrize("device, same_host, expected", [
    ("cpu", True, "shm"), ("cuda", True, "cuda_ipc"), ("cuda:1", False, "nccl"), ("cpu", False, "inline"),
])
def test_defaults(device, same_host, expected):
    assert choose_transport(device, same_host) == expected


def test_override_wins_and_is_validated():
    assert choose_transport("cuda", True, override="inline") == "inline"
    with pytest.raises(ValueError, match=r"unknown transport 'rdma'.*\['cuda_ipc', 'inline', 'nccl', 'shm'\]"):
        choose_transport("cpu", True, override="rdma")


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="tensor_device"):
        choose_transport("mps", True)
