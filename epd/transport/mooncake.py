"""The encoder cache store on Mooncake Store (``encoder_cache_store: mooncake``).

Encoders (which read and write it) and prefill workers (which read rows from it, ``store``
handles) are clients of the store only: they contribute no memory (the store's segments are held by
segment servers, ``mooncake_client``, which outlive any worker: an encoder that restarts finds the
cluster's work still there). Mooncake's transfer engine moves the bytes (TCP here, RDMA where
the hosts have it) and its master keeps the keys.

A put replaces what the key held (Mooncake's upsert): two encoders that put the same item leave one
entry with the same bytes, and a damaged entry is replaced by the next encoding of its item. The
library logs to stderr; its INFO lines are off (``MC_LOG_LEVEL``) unless set otherwise.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("epd.transport")

_LOCAL_BUFFER_BYTES = 64 * 1024 * 1024  # the client's staging buffer for gets and puts


class MooncakeStoreError(RuntimeError):
    """The store could not be reached or refused an operation (the message names it)."""


def _import_store():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise MooncakeStoreError(
            f"encoder_cache_store mooncake needs Mooncake's wheel ({err}): pip install "
            "mooncake-transfer-engine-non-cuda (CPU hosts) or mooncake-transfer-engine (CUDA hosts), after the "
            "Debian packages libibverbs1 and librdmacm1") from None
    return MooncakeDistributedStore


class MooncakeBackend:
    """``StoreBackend`` over a ``MooncakeDistributedStore`` client. ``host``: the address this client
    binds and gives its peers (the worker's own). It joins the master on a thread of its own, again
    and again until it has: joining blocks while the master is away, and a store that is not up yet
    when the encoder starts is an outage like any other (the encoder runs on its own cache
    meanwhile), not a failed start or a stalled encoder."""

    def __init__(self, master: str, *, host: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", device_names: str = "", retry_s: float = 2.0) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)  # its TCP transfers on the worker's address
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # read as the library loads
        store_class = _import_store()  # a missing wheel is an error at start
        self.master = master
        self.max_entry_bytes = _LOCAL_BUFFER_BYTES  # a put stages the entry in the client's buffer
        self._store = None
        self._closed = threading.Event()
        self._lock = threading.Lock()  # _store between the join thread and close
        setup = (host, metadata_server, 0, _LOCAL_BUFFER_BYTES, protocol, device_names, master)
        self._joiner = threading.Thread(target=self._join, args=(store_class, setup, retry_s),
                                        name="epd-mooncake-join", daemon=True)
        self._joiner.start()

    def _join(self, store_class, setup: tuple, retry_s: float) -> None:
        while not self._closed.is_set():
            try:
                store = store_class()
                code = store.setup(*setup)
            except Exception as err:  # noqa: BLE001 - tried again, as a refused join is
                code = f"{type(err).__name__}: {err}"
            if code == 0:
                with self._lock:
                    if self._closed.is_set():  # closed while joining: this client is nobody's
                        store.close()
                        return
                    self._store = store
                log.info("encoder cache store: joined the Mooncake master at %s", self.master)
                return
            log.debug("encoder cache store: joining the Mooncake master at %s: %s", self.master, code)
            self._closed.wait(retry_s)

    def joined(self) -> bool:
        return self._store is not None

    def wait_joined(self, timeout_s: float) -> bool:
        self._joiner.join(timeout_s)
        return self._store is not None

    def _client(self):
        if self._store is None:
            raise MooncakeStoreError(f"not joined to the Mooncake master at {self.master} (yet)")
        return self._store

    def get(self, key: str) -> bytes | None:
        store = self._client()
        value = store.get(key)
        if value:
            return bytes(value)
        if store.is_exist(key) < 0:  # an empty answer is a miss, or the master unreachable: ask which
            raise MooncakeStoreError(f"the Mooncake master at {self.master} did not answer")
        return None

    def put(self, key: str, value: bytes) -> None:
        """Insert or replace: an entry a reader rejected is replaced by the next encoding, even
        while that reader's lease on it (Mooncake keeps a read object for a while) stops its removal."""
        code = self._client().upsert(key, value)
        if code != 0:
            raise MooncakeStoreError(f"put of {len(value)} bytes returned {code}")

    def put_first(self, key: str, value: bytes) -> bytes | None:
        """Mooncake keeps the first write of a key (``put`` of a key that exists changes nothing):
        write, then read back who won."""
        store = self._client()
        code = store.put(key, value)
        if code != 0:
            raise MooncakeStoreError(f"put of a claim returned {code}")
        held = store.get(key)
        return bytes(held) if held else None  # None: the winner's write is not readable yet

    def remove(self, key: str) -> None:
        self._client().remove(key)  # refused while a lease holds it, or gone already: put replaces it

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            store, self._store = self._store, None
        if store is not None:
            store.close()
