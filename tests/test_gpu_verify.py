"""``scripts/gpu_verify.sh --dry-run``: the one-command GPU check runs on the CPU, end to end (its
pytest of the CUDA tests, which skip here, and every bench phase with tiny shapes), and writes the
files a GPU run would; so the first CUDA machine finds a script that works. On the CPU its
"device" is the CPU: the comparisons it makes are of the CPU with itself, so what is checked here is
the run's shape (every phase, every file, the JSON's fields) and that a failing phase is reported
as failed, not the figures."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _verify(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_verify.sh"), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OUT": str(tmp_path)}, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_the_dry_run_writes_every_result_comparing_the_cpu_with_itself(tmp_path):
    import glob
    import tempfile

    work_dirs = os.path.join(tempfile.gettempdir(), "epd-gpu-bench-*")
    before = set(glob.glob(work_dirs))
    done = _verify(tmp_path, "--dry-run")
    assert set(glob.glob(work_dirs)) <= before, "the bench left its checkpoints behind"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    # the phases, and the copy bandwidth the ipc phase measured (the decode phase's bound reads it)
    assert sorted(results) == ["bandwidth_gb_s", "dry_run", "phases"] and results["dry_run"] is True
    assert results["bandwidth_gb_s"] > 0
    phases = results["phases"]
    assert sorted(phases) == ["decode", "encoder", "env", "fidelity", "ipc", "overlap", "profile",
                              "tensor_parallel"] and \
        all(p["ok"] for p in phases.values()), phases
    for name, phase in phases.items():  # every phase says how it went and how long it took
        assert phase["ok"] is True and isinstance(phase["seconds"], float) and "partial" not in phase, (name, phase)
    suite = ElementTree.parse(tmp_path / "cuda_tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) > 20 and int(suite.get("errors")) == int(suite.get("failures")) == 0
    assert int(suite.get("skipped")) == int(suite.get("tests"))  # no CUDA here: every one skips, none is lost
    assert phases["fidelity"]["device_vs_cpu_fp32_greedy_identical"] is True
    assert phases["fidelity"]["bf16_vs_fp32_first_token_cosine"] >= 0.99
    assert phases["decode"]["tiny"][0]["tok_s"] > 0 and phases["ipc"]["shm"][0]["ms"] > 0
    # async scheduling against steps in order: the same tokens, and it did overlap
    assert phases["overlap"]["4"]["same_tokens"] is True and phases["overlap"]["4"]["async"]["overlapped_steps"] > 0
    assert [r["tokens"] for r in phases["encoder"]["rows"]] == [64, 128]  # 112 px images: 8 x 8 patches each
    # no GPUs here: the TP phase says so, and still checks the gloo ranks (TP 2 == TP 1)
    assert phases["profile"]["skipped"].startswith("the dry run")  # on a GPU it writes profile.json
    assert phases["tensor_parallel"]["cuda"] == "skipped: 0 GPU(s); TP over GPUs needs 2 or more"
    assert phases["tensor_parallel"]["cpu"]["ok"] is True and phases["tensor_parallel"]["ok"] is True
    for name in ("cuda_tests.xml", "env.txt", "log.txt"):
        assert (tmp_path / name).stat().st_size > 0, name


def _bench_module():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_phase_is_reported_as_failed_and_the_next_still_runs(tmp_path):
    bench = _bench_module()
    run = bench.Run(tmp_path / "results.json", dry_run=True, deadline_s=60)

    def broken(_run):
        raise RuntimeError("the kernel refused")

    run.phase("broken", broken)
    run.phase("fine", lambda _run: {"ms": 1.5})
    written = json.loads((tmp_path / "results.json").read_text())["phases"]
    assert written["broken"]["ok"] is False and written["broken"]["error"] == "RuntimeError: the kernel refused"
    assert "the kernel refused" in written["broken"]["trace"]
    assert written["fine"] == {"ok": True, "ms": 1.5, "seconds": written["fine"]["seconds"]}
    assert bench.failed_phases(run.results) == ["broken"]
    late = bench.Run(tmp_path / "late.json", dry_run=True, deadline_s=-1)
    late.phase("fine", lambda _run: {"ms": 1.5})
    assert json.loads((tmp_path / "late.json").read_text())["phases"]["fine"] == {"skipped": "past the deadline"}


def test_an_unknown_argument_is_refused(tmp_path):
    done = _verify(tmp_path, "--fast")
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr


def test_the_bench_refuses_to_measure_a_gpu_it_does_not_have(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"),
                           "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device here; use --dry-run" in done.stderr
