"""Processes as /proc shows them: what a test started, and whether it is gone."""
from __future__ import annotations

import os


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children start their own sessions; their parent stays)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its parent counts as gone: it runs nothing and holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
