"""A process-wide pool of gRPC channels, one per producer address.

Channels are expensive to open (a TCP + HTTP/2 handshake) and safe to share between threads, so a
consumer importing many handles from one producer reuses one channel.
"""
from __future__ import annotations

import threading

import grpc

from epd.wire.rpc import open_channel
from epd.wire.tls import process_tls


class ChannelPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        if not address:
            raise ValueError("empty gRPC address; expected host:port")
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                # mutual TLS when this process has a certificate (a tier started with tls_*), else plain
                channel = self._channels[address] = open_channel(address, process_tls())
            return channel

    def close_all(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


_POOL = ChannelPool()


def get_channel(address: str) -> grpc.Channel:
    return _POOL.get(address)


def close_all() -> None:
    _POOL.close_all()
