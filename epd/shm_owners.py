"""Who owns a shared-memory segment, and whether its owner still lives: segment names, the
producer's owner lock, and the cleanup of a dead producer's segments. No torch here: the local
supervisor reclaims a dead worker's segments the moment it notices the death, and importing
torch for that would take seconds on a busy host.

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
import os
import re
import secrets

SHM_DIR = "/dev/shm"
SHM_PREFIX = "epd_"
SEGMENT_MODE = 0o600  # only the producer's user may map a segment: embeddings are user data
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
            self._fd = _posixshmem.shm_open("/" + self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # a concurrent cleanup could unlink the file between create and lock; then start over
            if os.fstat(self._fd).st_nlink > 0:
                return
            os.close(self._fd)

    def new_segment_name(self) -> str:
        return f"{self.name}_{secrets.token_hex(16)}"

    def close(self) -> None:
        unlink_quietly(self.name)
        os.close(self._fd)


def unlink_quietly(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass  # already gone: a cleanup of a previous run, or a test that removed it


def owner_alive(name: str) -> bool:
    """True while the process that made ``name`` lives (it holds the owner lock). ``name`` is a
    segment's or an owner lock's own: a lock names itself (reading it as a segment's name would
    look for a lock that does not exist and call a live owner dead)."""
    match = _parse(name)
    lock_name = name if match is not None and match["token"] is None else owner_lock_name(name)
    try:
        fd = _posixshmem.shm_open("/" + lock_name, os.O_RDONLY, 0)
    except FileNotFoundError:
        return False  # a closing store removes its segments first, its lock last
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops our shared lock if we got it
    return False


def own_names(prefix: str = SHM_PREFIX) -> set[str]:
    """EPD segment and owner-lock names in /dev/shm that belong to this user (another program's
    file that merely starts with the prefix, or another user's, is not ours to judge or unlink)."""
    names = set()
    try:
        listing = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return names
    for name in listing:
        if _parse(name, prefix) is None:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_uid == os.geteuid():
                names.add(name)
        except FileNotFoundError:
            continue
    return names


def is_stale(name: str, prefix: str = SHM_PREFIX) -> bool:
    """Whether the producer of ``name`` (a segment's or an owner lock's) is gone: its lock is free,
    or there is no lock and its pid is not running."""
    match = _parse(name, prefix)
    if match is None:
        raise ValueError(f"{name!r} is not an EPD shared-memory name")
    return _owner_is_dead(_lock_name(match, prefix), int(match["pid"]))


def cleanup_stale_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Unlink the segments (and owner locks) of producers that died without closing their store.

    A restarted producer calls this at start. Only the caller's own files are touched (others can't
    be unlinked from sticky /dev/shm anyway). Returns the names removed.
    """
    by_owner: dict[str, list[str]] = {}
    for name in own_names(prefix):
        by_owner.setdefault(_lock_name(_parse(name, prefix), prefix), []).append(name)
    removed: list[str] = []
    for lock_name, names in by_owner.items():
        if _owner_is_dead(lock_name, int(_parse(lock_name, prefix)["pid"])):
            # segments first, lock last: the same order a clean close uses
            for name in sorted(names, key=lambda n: n == lock_name):
                unlink_quietly(name)
                removed.append(name)
    return removed


def _lock_name(match: re.Match, prefix: str) -> str:
    """The owner lock of a parsed segment or lock name (a lock names itself)."""
    return f"{prefix}{match['pid']}_{match['owner']}"


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
