"""Which transport a producer should use for a given consumer."""
from __future__ import annotations

from epd.transport.base import TRANSPORTS

# (tensor on CUDA?, consumer on the same host?) -> transport
_DEFAULTS = {
    (False, True): "shm",       # zero-copy mapping
    (True, True): "cuda_ipc",   # the consumer maps our device memory
    (True, False): "nccl",      # GPU to GPU over the network
    (False, False): "inline",   # bytes over gRPC
}


def choose_transport(tensor_device: str, same_host: bool, override: str | None = None) -> str:
    """``tensor_device`` is a torch device string ("cpu", "cuda", "cuda:1"); ``override`` (a config
    value) wins when set, after checking it names a transport."""
    if override:
        if override not in TRANSPORTS:
            raise ValueError(f"unknown transport {override!r}; expected one of {TRANSPORTS.names()}")
        return override
    device_type = tensor_device.split(":", 1)[0]
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"tensor_device must be 'cpu' or 'cuda[:N]', got {tensor_device!r}")
    return _DEFAULTS[(device_type == "cuda", bool(same_host))]
