"""gRPC settings and servicer helpers every process shares (no torch: the SDK imports this too).

One options constant for every channel and server: messages may carry encoded images, so both
directions allow 64 MiB; servers never share a port silently (``so_reuseport`` 0: a taken port is
a bind error, not a second server that quietly gets half the connections)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import grpc

from epd import loops
from epd.errors import RETRY_AFTER_KEY

MiB = 1024 * 1024
MAX_MESSAGE_BYTES = 64 * MiB
_MESSAGE_OPTIONS = (("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES))
# a worker restarted on its port is found again within 2 s (gRPC's default backoff grows to 120 s)
CHANNEL_OPTIONS = (*_MESSAGE_OPTIONS, ("grpc.max_reconnect_backoff_ms", 2000))
SERVER_OPTIONS = (*_MESSAGE_OPTIONS, ("grpc.so_reuseport", 0))


def open_channel(address: str, tls=None, *, aio: bool = False, options=()):
    """A channel to ``address``: plain, or mutual TLS with ``tls`` (an ``epd.wire.tls.MutualTls``)."""
    grpc_module = grpc.aio if aio else grpc
    opts = [*CHANNEL_OPTIONS, *options]
    if tls is None:
        return grpc_module.insecure_channel(address, options=opts)
    return grpc_module.secure_channel(address, tls.channel_credentials(), options=[*opts, *tls.channel_options()])


def add_port(server, address: str, tls=None) -> int:
    """Bind ``address`` on a grpc or grpc.aio server, demanding client certificates with ``tls``;
    -> the port (0 when it cannot be bound)."""
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError:
        return 0


def abort_with(context, err) -> None:
    """End a call with an ``EPDError``'s own status (``epd.errors`` maps it); raises like ``context.abort``."""
    context.abort(err.grpc_status(), err.message)


async def abort_with_async(context: grpc.aio.ServicerContext, err, message: str | None = None) -> None:
    """``abort_with`` for grpc.aio servicers (``message`` replaces the error's own); an overloaded
    answer carries its retry hint in the trailing metadata."""
    hint_s = getattr(err, "retry_after_s", None)
    trailing = ((RETRY_AFTER_KEY, format(hint_s, "g")),) if hint_s is not None else ()
    await context.abort(err.grpc_status(), message or err.message, trailing_metadata=trailing)


def retry_after_s(err: grpc.RpcError) -> float | None:
    """The retry hint a server sent with RESOURCE_EXHAUSTED (sync or grpc.aio call), if any."""
    for key, value in err.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None


def remaining_s(context, default_s: float) -> float:
    """Seconds left on the caller's deadline, at most ``default_s`` (the bound when it set none)."""
    left = context.time_remaining()
    return default_s if left is None else min(left, default_s)


class AioServerThread:
    """A grpc.aio server on an event loop of its own thread, for callers that are not async (a tier's
    main, a Ray actor, a test). Handlers are coroutines: an in-flight request costs a coroutine, not
    a thread, so no pool size caps how many requests a server holds, and a health check never waits
    behind them."""

    def __init__(self, name: str) -> None:
        self.loop = loops.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        self._stops: list[Callable[[float], Awaitable[None]]] = []

    def also_stop(self, stop: Callable[[float], Awaitable[None]]) -> None:
        """``stop(grace_s)`` runs on the loop beside the gRPC server's own stop (another listener)."""
        self._stops.append(stop)

    def run(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def bind(self, address: str, *, migration_pool=None, tls=None, timeout_s: float = 30.0) -> int:
        """Make the server and bind ``address`` (host:port, port 0: a free one); -> the port. A port
        that cannot be bound is a ``RuntimeError``. ``migration_pool`` runs synchronous handlers;
        with ``tls`` (``epd.wire.tls.MutualTls``) only clients with a certificate from its CA get in."""
        async def bind() -> int:
            self.server = grpc.aio.server(migration_thread_pool=migration_pool, options=SERVER_OPTIONS)
            port = add_port(self.server, address, tls)
            if port == 0:
                raise RuntimeError(f"cannot bind {address} (taken, or not an address of this host)")
            return port

        return self.run(bind(), timeout_s)

    def start(self, add_servicers: Callable[[grpc.aio.Server], None], *, timeout_s: float = 30.0) -> None:
        """Add the servicers and start serving."""
        async def start() -> None:
            add_servicers(self.server)
            await self.server.start()

        self.run(start(), timeout_s)

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the server (in-flight calls get ``grace_s``), then the loop and its thread."""
        if not self.loop.is_running():
            return
        stops = [*([self.server.stop] if self.server is not None else []), *self._stops]
        if stops:
            async def stop_all() -> None:
                await asyncio.gather(*(stop(grace_s) for stop in stops), return_exceptions=True)
            try:
                self.run(stop_all(), grace_s + 5.0)
            except Exception:  # noqa: BLE001 - stopping anyway; the loop goes next
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()
