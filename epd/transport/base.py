"""The transport protocol and its registry.

A transport fills a handle's body on the producer side and turns a body back into a tensor on the
consumer side. Adding one is a file that registers itself here; ``TensorStore``, ``import_tensor``
and ``choose_transport`` never branch on transport names.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from epd.registry import Registry
from epd.v1 import tensor_pb2

if TYPE_CHECKING:
    import grpc

    from epd.transport.leases import TensorStore


class Reclaimable(Protocol):
    """Something a lease holds besides the tensor (a shm segment, a pending NCCL send)."""

    def reclaim(self, reason: str) -> None:
        """``reason`` is "released", "unused" (released, and nobody imported it), "expired" or
        "closed"; only "released" and "unused" prove no consumer still reads it."""


@dataclass
class Exported:
    """What the store keeps alive under a lease until it is released or expires."""

    payload: torch.Tensor | None  # Fetch streams it, NCCL sends it, CUDA IPC keeps its memory alive
    resource: Reclaimable | None = None
    keepalive: tuple = ()  # e.g. the interprocess CUDA event the consumer will open


@dataclass(frozen=True)
class ImportContext:
    device: torch.device
    channel_factory: Callable[[str], grpc.Channel]
    timeout_s: float  # bounds every network wait of the import: no hang when the producer is gone


def ready_event_after_writes(tensor: torch.Tensor | None):
    """CUDA: an interprocess event recorded now on this thread's stream, after the kernels that
    wrote ``tensor``: what its consumers (other processes, over CUDA IPC) wait on. CPU: None."""
    if tensor is None or not tensor.is_cuda:
        return None
    event = torch.cuda.Event(interprocess=True)
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def wait_for_producer(tensor: torch.Tensor, ready_event) -> None:
    """Before this thread's stream reads a CUDA ``tensor`` written on another stream."""
    if ready_event is not None and tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).wait_event(ready_event)


class Transport(Protocol):
    name: str
    # the consumer must see the producer's host (its shared memory, its GPUs): such a handle can
    # only go to a worker with the same host_id
    same_host_only: bool

    def export(self, store: TensorStore, tensor: torch.Tensor, handle: tensor_pb2.TensorHandle,
               ready_event: torch.cuda.Event | None = None) -> Exported:
        """Fill ``handle``'s body (and ready event); return what the lease must keep alive.
        ``ready_event``: recorded by the producer on the stream that wrote ``tensor`` (CUDA), so
        readers wait for exactly those writes; without it, the exporting thread's current stream."""

    def import_(self, handle: tensor_pb2.TensorHandle, dtype: torch.dtype, shape: tuple[int, ...],
                ctx: ImportContext) -> torch.Tensor:
        """Return the tensor the body describes (a view into shared memory where possible)."""


TRANSPORTS: Registry[Transport] = Registry("transport")


def exporting_transports() -> list[str]:
    """The transports a producer can hand a tensor over by (what ``--transport`` may name); a
    ``store`` handle is read where an encoder put the rows, nobody exports one."""
    return [name for name in TRANSPORTS.names() if getattr(TRANSPORTS.get(name), "exports", True)]
