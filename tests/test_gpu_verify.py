"""``scripts/gpu_verify.sh --dry-run``: the one-command GPU check runs on the CPU, end to end (its
pytest of the CUDA tests, which skip here, and every bench phase with tiny shapes), and writes the
files a GPU run would; so the first CUDA machine finds a script that works."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _verify(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_verify.sh"), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OUT": str(tmp_path)}, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_the_dry_run_writes_every_result(tmp_path):
    done = _verify(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["dry_run"] is True
    phases = results["phases"]
    assert sorted(phases) == ["decode", "encoder", "env", "fidelity", "ipc"] and all(p["ok"] for p in phases.values()), \
        phases
    assert phases["fidelity"]["device_vs_cpu_fp32_greedy_identical"] is True
    assert phases["fidelity"]["bf16_vs_fp32_first_token_cosine"] >= 0.99
    assert phases["decode"]["tiny"][0]["tok_s"] > 0 and phases["ipc"]["shm"][0]["ms"] > 0
    assert [r["tokens"] for r in phases["encoder"]["rows"]] == [64, 128]  # 112 px images: 8 x 8 patches each
    for name in ("cuda_tests.xml", "env.txt", "log.txt"):
        assert (tmp_path / name).stat().st_size > 0, name


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
