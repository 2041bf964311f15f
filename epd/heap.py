"""How an EPD program sets its heaps: Python's garbage collector, for serving once it has started
and for its exit, and the C allocator's return of freed memory. Only a program does (``epd ...``
run, a worker forked by the zygote, a tensor-parallel rank): a caller that imported EPD and goes on
(a test, a script with ``epd.LLM``) keeps its collector and its allocator as they were, its objects
collectable."""
from __future__ import annotations

import ctypes
import gc
import os

YOUNG_COLLECTION_OBJECTS = 10_000  # the youngest generation's threshold while serving (Python's: 700)
# glibc's mallopt: blocks of up to MMAP_THRESHOLD_BYTES come from the heap, not a fresh mapping
# each (a step's largest tensors: the logits of a 152k vocabulary are 39 MB at batch 64, 155 MB at
# 256), and a heap keeps up to TRIM_THRESHOLD_BYTES free at its top instead of handing it back
MMAP_THRESHOLD_BYTES = 512 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_ours = False  # this process is an EPD program


def own() -> None:
    """This process is an EPD program: what it holds once started may be frozen
    (``settle_for_serving``) and left at its exit (``freeze_for_exit``), and the memory it frees
    is kept for its next use (``keep_freed_memory``)."""
    global _ours
    _ours = True
    keep_freed_memory()


def keep_freed_memory(environ=None) -> bool:
    """Keep freed memory in the process (glibc only; a user's own ``MALLOC_*`` / ``GLIBC_TUNABLES``
    settings win) -> whether it was set. Why: an engine runs on its own loop thread, so glibc serves
    it from a thread arena, which hands the free top of its heap back to the kernel (madvise) as
    soon as a step's tensors are freed; the next step's tensors of the same size then fault their
    pages in again, zeroed by the kernel. A decode step at batch 256 (the logits, the softmax, a
    copy of the sampled rows: ~2 MB each) took 265-468 page faults, 0.5-0.8 ms of system CPU on top
    of 1.4-1.7 ms of its own here; with these settings 4-5. With glibc's defaults a block over 32 MiB
    is always a fresh mapping: the tiny preset's decode step at batch 64 (39 MB of logits, their
    softmax, the MLP's activations) spent 40-45% of its 67-72 ms faulting pages in; 35-42 ms now."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _MALLOC_ENV) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator's policy stays
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def settle_for_serving() -> None:
    """Started (a program only): what the process loaded (torch's and transformers' objects, the
    model, the tokenizer, the app) is collected once and frozen out of the collector's reach
    (``gc.freeze``): every full collection while serving walked all of it again, 100-250 ms of CPU
    each here, a few a minute under load. Frozen objects are still freed by reference count; only
    a reference cycle among them would stay.

    And the youngest generation is collected every 10,000 net new objects instead of 700: a router
    streaming 256 requests collected it ~90 times a second (a step's or a token's short-lived
    objects are most of what it allocates and frees), each time walking the requests' live objects
    again. Together that was ~10% of a busy router's CPU and ~5% of a decode worker's; now below
    what ``benchmarks/control_plane.py --collector`` resolves (docs/benchmarks.md)."""
    if _ours:
        freeze_loaded()
        gc.set_threshold(YOUNG_COLLECTION_OBJECTS, *gc.get_threshold()[1:])


def freeze_loaded() -> None:
    """What the process holds now, its garbage collected first, moved out of the collector's reach
    for good (the zygote does this before it forks: its children then neither scan those objects
    nor copy their pages by touching them)."""
    gc.collect()
    gc.freeze()


def freeze_for_exit() -> None:
    """The process's work is done and it is about to exit: what it allocated is moved out of the
    garbage collector's reach (``gc.freeze``), so the interpreter's teardown does not walk it. With
    torch and transformers loaded those final collections cost 0.6-1.3 s of CPU here, at every
    worker's, router's and command's exit (a supervisor restarting workers, a test suite starting
    hundreds). Everything else of the exit stays: atexit handlers, objects freed by reference
    count, stdio flushed."""
    gc.freeze()
