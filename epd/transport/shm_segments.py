"""POSIX shared-memory segments: naming, creation, consumer mapping, and stale-segment cleanup.

We call ``_posixshmem.shm_open`` and ``mmap`` directly instead of ``multiprocessing.shared_memory``:
its resource tracker unlinks every segment a process has *opened* when that process exits, so a
consumer exiting would delete the producer's segments.

Names: ``epd_<pid>_<owner>_<token>``. ``owner`` (64 random bits) names one producer store and
``token`` (128 random bits) one segment, so a name can't be guessed. The producer also creates
``epd_<pid>_<owner>`` and holds an exclusive ``flock`` on it for its whole life. The kernel drops
that lock when the process dies, however it dies, so "is the producer alive?" is answered by
trying the lock. Unlike a pid check this also works when producer and consumer share /dev/shm but
not a pid namespace (two containers of one pod), and is not fooled by zombies or reused pids.
"""
from __future__ import annotations

import _posixshmem
import fcntl
import mmap
import os
import re
import secrets
import threading
import time
from collections import OrderedDict

import torch

SHM_DIR = "/dev/shm"
SHM_PREFIX = "epd_"
_MODE = 0o600  # only the producer's user may map a segment: embeddings are user data
_NAME_RE = r"(?P<pid>\d+)_(?P<owner>[0-9a-f]{16})(?:_(?P<token>[0-9a-f]{32}))?"


def _parse(name: str, prefix: str = SHM_PREFIX) -> re.Match | None:
    if not name.startswith(prefix):
        return None
    return re.fullmatch(_NAME_RE, name[len(prefix):])


def owner_lock_name(segment_name: str) -> str:
    """``epd_<pid>_<owner>_<token>`` -> ``epd_<pid>_<owner>``."""
    return segment_name.rsplit("_", 1)[0]


def is_segment_name(name: str) -> bool:
    match = _parse(name)
    return match is not None and match["token"] is not None


class OwnerLock:
    """The producer's liveness marker (see module docstring)."""

    def __init__(self) -> None:
        while True:
            self.name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
            self._fd = _posixshmem.shm_open("/" + self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, _MODE)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # a concurrent cleanup could unlink the file between create and lock; then start over
            if os.fstat(self._fd).st_nlink > 0:
                return
            os.close(self._fd)

    def new_segment_name(self) -> str:
        return f"{self.name}_{secrets.token_hex(16)}"

    def close(self) -> None:
        _unlink_quietly(self.name)
        os.close(self._fd)


class Segment:
    """Producer side of one segment: created once, mapped shared, reused through the arena's pool."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, _MODE)
        try:
            os.fchmod(fd, _MODE)  # shm_open's mode passes through the umask; say it exactly
            os.ftruncate(fd, capacity_bytes)  # sparse: tmpfs pages appear only when first written
            self.mm = mmap.mmap(fd, capacity_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            _unlink_quietly(name)
            raise
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8)  # [capacity_bytes]

    def unlink(self) -> None:
        _unlink_quietly(self.name)
        self.view = None  # the mapping goes when the last view of it does (consumers in-process too)
        self.mm = None


def _unlink_quietly(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass  # already gone: a cleanup of a previous run, or a test that removed it


def owner_alive(segment_name: str) -> bool:
    """True while the process that created ``segment_name`` lives (it holds the owner lock)."""
    try:
        fd = _posixshmem.shm_open("/" + owner_lock_name(segment_name), os.O_RDONLY, 0)
    except FileNotFoundError:
        return False  # a closing store removes its segments first, its lock last
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops our shared lock if we got it
    return False


def cleanup_stale_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink the segments (and owner locks) of producers that died without closing their store.

    A restarted producer calls this at start. Only the caller's own files are touched (others can't
    be unlinked from sticky /dev/shm anyway). Returns the names removed.
    """
    by_owner: dict[str, list[str]] = {}
    for name in os.listdir(SHM_DIR):
        match = _parse(name, prefix)
        if match is None:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_uid != os.geteuid():
                continue
        except FileNotFoundError:
            continue
        lock_name = f"{prefix}{match['pid']}_{match['owner']}"
        by_owner.setdefault(lock_name, []).append(name)
    removed: list[str] = []
    for lock_name, names in by_owner.items():
        if _owner_is_dead(lock_name, int(_parse(lock_name, prefix)["pid"])):
            # segments first, lock last: the same order a clean close uses
            for name in sorted(names, key=lambda n: n == lock_name):
                _unlink_quietly(name)
                removed.append(name)
    return removed


def _owner_is_dead(lock_name: str, pid: int) -> bool:
    try:
        fd = _posixshmem.shm_open("/" + lock_name, os.O_RDONLY, 0)
    except FileNotFoundError:
        # no lock (an old layout, or a crash between creating it and a segment): fall back to the pid
        return not _pid_alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MappingCache:
    """Consumer side: keeps recent segment mappings so a pooled segment is mapped (and page-faulted)
    once, not once per tensor. Faulting a fresh mapping costs about as much as reading it.

    A cached mapping of a segment the producer has since unlinked would pin its memory, so names
    are re-checked at most every ``recheck_period_s`` and dropped once gone; ``max_bytes`` bounds
    what can be pinned in between.
    """

    def __init__(self, max_entries: int = 32, max_bytes: int = 1 << 30, recheck_period_s: float = 1.0) -> None:
        self.max_entries, self.max_bytes, self.recheck_period_s = max_entries, max_bytes, recheck_period_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[int, mmap.mmap]] = OrderedDict()  # name -> (inode, mapping)
        self._bytes = 0
        self._last_check_s = time.monotonic()

    def map(self, name: str) -> mmap.mmap:
        """Map ``name`` read-write shared; FileNotFoundError when it is gone."""
        self._drop_gone()
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
        try:
            st = os.fstat(fd)
            with self._lock:
                hit = self._entries.get(name)
                if hit is not None and hit[0] == st.st_ino and len(hit[1]) == st.st_size:
                    self._entries.move_to_end(name)
                    return hit[1]
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if st.st_size <= self.max_bytes:
            with self._lock:
                self._evict(name)
                self._entries[name] = (st.st_ino, mm)
                self._bytes += st.st_size
                while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                    self._evict(next(iter(self._entries)))
        return mm

    def clear(self, name: str | None = None) -> None:
        """Forget one segment's mapping, or all of them."""
        with self._lock:
            for cached in [name] if name is not None else list(self._entries):
                self._evict(cached)

    def _evict(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._bytes -= len(entry[1])  # tensors still viewing it keep the mapping alive

    def _drop_gone(self) -> None:
        now_s = time.monotonic()
        if now_s - self._last_check_s < self.recheck_period_s:
            return
        self._last_check_s = now_s
        with self._lock:
            for name, (inode, _) in list(self._entries.items()):
                try:
                    if os.stat(os.path.join(SHM_DIR, name)).st_ino == inode:
                        continue
                except FileNotFoundError:
                    pass
                self._evict(name)
