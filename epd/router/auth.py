"""API keys for the router's public APIs (OpenAI HTTP and gRPC): a request must carry
``Authorization: Bearer <key>`` (gRPC: the ``authorization`` metadata) with one of the keys.

Keys come from, in any mix: the config (``api_keys``, flag ``--api-key``: shown by ``ps``, so for
tests and local use), the ``EPD_API_KEY`` environment variable (comma-separated), and
``api_key_file`` (one key per line, ``#`` comments). The file is read again when it changes, so
keys rotate without a restart: add the new key, move clients over, remove the old one. No key
configured: the APIs are open. A key is never logged, put in a metric label or echoed in an error.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from epd.errors import Unauthenticated

log = logging.getLogger("epd.router.auth")
ENV_API_KEY = "EPD_API_KEY"
ENV_ADMIN_TOKEN = "EPD_ADMIN_TOKEN"
_RECHECK_S = 1.0  # how often the key file's stamp is looked at (a rotation takes effect within it)


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), key_file: str | Path | None = None,
                 environ: Mapping[str, str] | None = None, env_var: str = ENV_API_KEY) -> None:
        """``env_var``: the environment variable with more keys, comma-separated (the admin API's
        tokens use ``EPD_ADMIN_TOKEN``)."""
        environ = os.environ if environ is None else environ
        self._fixed = tuple(_clean([*keys, *environ.get(env_var, "").split(",")]))
        self._file = Path(key_file) if key_file else None
        self._file_keys: tuple[str, ...] = ()
        self._stamp: tuple[int, int] | None = None
        self._checked_at = float("-inf")
        self._lock = threading.Lock()
        if self._file is not None:
            if not self._file.is_file():
                raise ValueError(f"api_key_file {self._file} is not a readable file")
            self._reload()

    def first(self) -> str | None:
        """One of the keys (the given ones first, then the file's): what a client of this server
        that holds the same settings sends (``epd serve`` to its router's admin API)."""
        if self._file is not None:
            self._reload()
        return next(iter((*self._fixed, *self._file_keys)), None)

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self._file is not None

    def check_bearer(self, authorization: str | None) -> str:
        """Raise ``Unauthenticated`` unless ``authorization`` is ``Bearer <a key>``; -> the key's
        fingerprint (what rate limits and logs may name), "" when no key is set."""
        if not self.enabled:
            return ""
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        matched = self._match(presented.strip())
        if matched is None:
            raise Unauthenticated("invalid API key")
        return fingerprint(matched)

    def allows(self, presented: str) -> bool:
        return self._match(presented) is not None

    def _match(self, presented: str) -> str | None:
        """Constant-time against every key: the time taken says nothing about how close it came."""
        self._maybe_reload()
        given, matched = presented.encode(), None
        for key in (*self._fixed, *self._file_keys):
            if hmac.compare_digest(given, key.encode()):
                matched = key
        return matched

    def _maybe_reload(self) -> None:
        if self._file is None or time.monotonic() - self._checked_at < _RECHECK_S:
            return
        with self._lock:
            self._checked_at = time.monotonic()
            try:
                st = self._file.stat()
            except OSError:
                if self._file_keys:
                    log.warning("api_key_file %s is gone: its keys no longer admit anyone", self._file)
                self._file_keys, self._stamp = (), None
                return
            if (st.st_mtime_ns, st.st_size) != self._stamp:
                self._reload()

    def _reload(self) -> None:
        try:
            st = self._file.stat()
            lines = self._file.read_text().splitlines()
        except OSError as err:
            log.warning("cannot read api_key_file %s (%s): its keys no longer admit anyone", self._file,
                        err.strerror)
            self._file_keys, self._stamp = (), None
            return
        self._file_keys = tuple(_clean(line.split("#", 1)[0] for line in lines))
        self._stamp = (st.st_mtime_ns, st.st_size)
        log.info("api_key_file %s: %d key(s)", self._file, len(self._file_keys))


def fingerprint(key: str) -> str:
    """A name for a key that does not reveal it: 'key-' and 12 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _clean(keys: Iterable[str]) -> list[str]:
    return [k.strip() for k in keys if k.strip()]
