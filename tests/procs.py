"""Processes as /proc shows them: what a test started, and whether it is gone."""
from __future__ import annotations

from epd.server.parent import descendants  # noqa: F401 - what a test started, with gone()


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its parent counts as gone: it runs nothing and holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return True
