"""POSIX shared-memory segments: creation and consumer mapping (names, owner locks and the cleanup
of a dead producer's segments: ``epd.shm_owners``).

We call ``_posixshmem.shm_open`` and ``mmap`` directly instead of ``multiprocessing.shared_memory``:
its resource tracker unlinks every segment a process has *opened* when that process exits, so a
consumer exiting would delete the producer's segments.
"""
from __future__ import annotations

import _posixshmem
import mmap
import os
import threading
import time
from collections import OrderedDict

import torch

from epd.shm_owners import SEGMENT_MODE, SHM_DIR, unlink_quietly


class Segment:
    """Producer side of one segment: created once, mapped shared, reused through the arena's pool."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.generation = ""  # what the header names while the segment holds a made tensor
        self.storage_ptr = 0  # that tensor's storage address
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
        try:
            os.fchmod(fd, SEGMENT_MODE)  # shm_open's mode passes through the umask; say it exactly
            os.ftruncate(fd, capacity_bytes)  # sparse: tmpfs pages appear only when first written
            self.mm = mmap.mmap(fd, capacity_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            unlink_quietly(name)
            raise
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8)  # [capacity_bytes]

    def unlink(self) -> None:
        unlink_quietly(self.name)
        self.view = None  # the mapping goes when the last view of it does (consumers in-process too)
        self.mm = None


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
