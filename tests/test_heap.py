"""The C allocator's settings of an EPD program (``epd.heap.keep_freed_memory``): a step's large
tensors on an engine's loop thread reuse the memory the last step freed instead of faulting fresh
pages in each time. Counted in page faults (not timed), in a fresh process each."""
from __future__ import annotations

import subprocess
import sys

import pytest

from epd import heap

_STEPS = """
import resource, sys, threading
import torch
torch.set_num_threads(1)
from epd import heap
ROWS, VOCAB, STEPS = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory(environ={})
faults = []
def steps():  # on a thread of its own, as an engine's loop: the logits, their softmax, a few small tensors
    # what stays from before (an engine's own state) lies below the steps' tensors in the thread's
    # heap; a heap with nothing else in it is unmapped whole when it empties, whatever the settings
    state = [torch.full((ROWS, VOCAB), 0.0), torch.empty(3, VOCAB)]
    held = []
    for step in range(20 + STEPS):
        if step == 20:
            start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        logits = torch.full((ROWS, VOCAB), -1e4)
        probs = torch.softmax(logits, dim=-1)
        held.append(torch.empty(1000))
        del held[:-50]
    faults.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start) / STEPS)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(faults[0])
"""


def _faults_per_step(mode: str, rows: int, vocab: int, steps: int) -> float:
    done = subprocess.run([sys.executable, "-c", _STEPS, mode, str(rows), str(vocab), str(steps)], capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(heap.__file__).rsplit("/epd/", 1)[0]})
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_loop_threads_step_tensors_reuse_freed_memory_instead_of_faulting_pages_in():
    """The zero-cost model's logits at batch 256 (2 MB): no fault at all once kept."""
    default, kept = _faults_per_step("default", 256, 2048, 300), _faults_per_step("keep", 256, 2048, 300)
    assert default > 20, f"glibc's defaults no longer fault here ({default:.1f} a step): the test shows nothing"
    assert kept < 2, f"{kept:.1f} page faults a step with the memory kept (glibc's defaults: {default:.1f})"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_real_vocabularys_logits_past_glibcs_mapping_threshold_are_mostly_reused():
    """Past 32 MiB glibc maps every block afresh by default (the logits of a 152k vocabulary at
    batch 64: 39 MB, ~9,500 pages each time); kept, most steps reuse them (how many still fault
    varies between runs here: 272-5,447 a step against 19,079)."""
    default, kept = _faults_per_step("default", 64, 151936, 40), _faults_per_step("keep", 64, 151936, 40)
    assert default > 5000, f"glibc's defaults no longer fault here ({default:.0f} a step): the test shows nothing"
    assert kept < default / 2, f"{kept:.0f} page faults a step with the memory kept (glibc's defaults: {default:.0f})"


def test_a_users_own_allocator_settings_win():
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX"):
        assert heap.keep_freed_memory(environ={name: "1"}) is False
    assert heap.keep_freed_memory(environ={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}) is False


def test_an_epd_program_keeps_freed_memory_from_its_start(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append("kept") or True)
    monkeypatch.setattr(heap, "_ours", False)  # restored after: this test process is no EPD program
    heap.own()
    assert calls == ["kept"]
