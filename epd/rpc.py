"""gRPC settings and servicer helpers every process shares (no torch: the SDK imports this too).

One options constant for every channel and server: messages may carry encoded images, so both
directions allow 64 MiB; servers never share a port silently (``so_reuseport`` 0: a taken port is
a bind error, not a second server that quietly gets half the connections)."""
from __future__ import annotations

MiB = 1024 * 1024
MAX_MESSAGE_BYTES = 64 * MiB
CHANNEL_OPTIONS = (("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES))
SERVER_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0))


def abort_with(context, err) -> None:
    """End a call with an ``EPDError``'s own status (``epd.errors`` maps it); raises like ``context.abort``."""
    context.abort(err.grpc_status(), err.message)


def remaining_s(context, default_s: float) -> float:
    """Seconds left on the caller's deadline, at most ``default_s`` (the bound when it set none)."""
    left = context.time_remaining()
    return default_s if left is None else min(left, default_s)
