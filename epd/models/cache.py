"""The on-disk cache for built artifacts (tokenizer files, preset checkpoints).

Several processes of one cluster may start at once and all find an entry missing; each builds into its
own temporary directory next to the entry and renames it into place. Rename is atomic on POSIX, so a
reader sees either no entry or a complete one; a loser of the race throws its copy away.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

ENV_CACHE_DIR = "EPD_CACHE_DIR"


def epd_cache_dir() -> Path:
    """`$EPD_CACHE_DIR`, else `~/.cache/epd`. Not created here."""
    configured = os.environ.get(ENV_CACHE_DIR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "epd"


@contextlib.contextmanager
def atomic_directory(final_dir: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes `final_dir` when the block exits cleanly.

    If `final_dir` already exists (another process won the race) the new copy is discarded, unless
    `replace` is set: then the old directory is moved aside and deleted. On an exception nothing is
    left behind.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it 0700; the cache is plain readable data
    try:
        yield tmp_dir
        for path in tmp_dir.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)  # some writers create files 0600
        if replace and final_dir.exists():
            _move_aside_and_delete(final_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
            # Another process renamed its complete copy first; ours is redundant.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _move_aside_and_delete(path: Path) -> None:
    trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return  # someone else already moved it
    shutil.rmtree(trash, ignore_errors=True)
