"""Which transport a producer should use for a given consumer, and what "the same host" means."""
from __future__ import annotations

import functools
import socket
from pathlib import Path

from epd.transport.base import TRANSPORTS, exporting_transports
from epd.v1 import tensor_pb2

# (tensor on CUDA?, consumer on the same host?) -> transport
_DEFAULTS = {
    (False, True): "shm",       # zero-copy mapping
    (True, True): "cuda_ipc",   # the consumer maps our device memory
    (True, False): "nccl",      # GPU to GPU over the network
    (False, False): "inline",   # bytes over gRPC
}
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def choose_transport(tensor_device: str, same_host: bool, override: str | None = None) -> str:
    """``tensor_device`` is a torch device string ("cpu", "cuda", "cuda:1"); ``override`` (a config
    value) wins when set, after checking it names a transport."""
    if override:
        if override not in exporting_transports():
            raise ValueError(f"unknown transport {override!r}; expected one of {exporting_transports()}")
        return override
    device_type = tensor_device.split(":", 1)[0]
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"tensor_device must be 'cpu' or 'cuda[:N]', got {tensor_device!r}")
    return _DEFAULTS[(device_type == "cuda", bool(same_host))]


def is_same_host(own_host_id: str, consumer_host_id: str) -> bool:
    """A consumer that names no host is on ours (a caller that does not know where it runs)."""
    return not consumer_host_id or consumer_host_id == own_host_id


def needs_same_host(handle: tensor_pb2.TensorHandle) -> bool:
    """Whether only a worker on the producer's host can import ``handle`` (shm, CUDA IPC)."""
    body = handle.WhichOneof("body")
    return body is not None and TRANSPORTS.get(body).same_host_only


@functools.cache
def local_host_id() -> str:
    """This machine as the processes on it share memory: its hostname and boot id. A container
    has its own hostname (and its own /dev/shm), so two pods on one node are two hosts."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:  # not Linux: the hostname alone
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()
