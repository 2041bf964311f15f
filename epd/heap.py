"""How an EPD program sets Python's garbage collector: for serving once it has started, and for its
exit. Only a program does (``epd ...`` run, a worker forked by the zygote, a tensor-parallel rank):
a caller that imported EPD and goes on (a test, a script with ``epd.LLM``) keeps its collector as
it was, its objects collectable."""
from __future__ import annotations

import gc

YOUNG_COLLECTION_OBJECTS = 10_000  # the youngest generation's threshold while serving (Python's: 700)
_ours = False  # this process is an EPD program


def own() -> None:
    """This process is an EPD program: what it holds once started may be frozen
    (``settle_for_serving``) and left at its exit (``freeze_for_exit``)."""
    global _ours
    _ours = True


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
