"""``epd profile``: one JSON file of what each stage costs here, measured, not assumed: every point
is there, positive, and the costs follow the work (a longer prompt costs a cold prefill more, a
cached prefix costs less than the cold prompt, a bigger image costs the encoder more)."""
from __future__ import annotations

import json
import os

import pytest

from epd.cli import main

pytestmark = pytest.mark.slow


def test_a_small_profile_measures_every_stage(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "tiny-qwen2-vl", "--out", str(out), "--device", "cpu",
                 "--image-sizes", "112,448", "--encoder-batches", "1,2", "--prefill-lengths", "64,1536",
                 "--decode-batches", "1,4", "--contexts", "128", "--decode-steps", "5", "--transfer-mb", "1",
                 "--repeats", "2", "--threads", "1"]) == 0
    profile = json.loads(out.read_text())
    assert profile["device"] == "cpu" and profile["host"]["cpus"] >= 1 and profile["host"]["threads"] == 1
    encoder = {(p["image_px"], p["batch"]): p["ms_per_item"] for p in profile["encoder"]}
    assert set(encoder) == {(112, 1), (112, 2), (448, 1), (448, 2)} and min(encoder.values()) > 0
    assert encoder[(448, 1)] > encoder[(112, 1)]  # 16x the patches
    prefill = {(p["prompt_tokens"], p["prefix_cached"]): p["ms_total"] for p in profile["prefill"]}
    assert set(prefill) == {(64, False), (64, True), (1536, False), (1536, True)}
    assert prefill[(1536, False)] > prefill[(64, False)]
    assert prefill[(1536, True)] < prefill[(1536, False)]  # all but the last block from the prefix cache
    decode = {(p["batch"], p["context_tokens"], p["temperature"]): p["ms_per_step"] for p in profile["decode"]}
    assert set(decode) == {(b, 128, t) for b in (1, 4) for t in (0.0, 1.0)} and min(decode.values()) > 0
    transfer = {(p["transport"], p["mb"]): p["ms_per_mb"] for p in profile["transfer"]}
    assert set(transfer) == {("shm", 1), ("inline", 1)} and min(transfer.values()) > 0
    router = {p["image_px"]: p["ms_per_request"] for p in profile["router"]}
    assert set(router) == {112, 448} and min(router.values()) > 0
    from epd.plan.costs import StageCosts  # what the simulator reads of it

    costs = StageCosts.from_profile(out)
    assert costs.threads == 1 and costs.router_ms(448 * 448, 99.0) == pytest.approx(router[448])
    assert costs.decode_ms(4, 128, sampled=True) == pytest.approx(decode[(4, 128, 1.0)])


def test_the_cpu_a_process_tree_spends_per_request_is_counted():
    """``epd profile --pipeline``'s CPU counter: what the tree (here this very process), its router
    (none here) and the client (this process again) spend per request, from the kernel's counters."""
    import time

    from epd.bench.pipeline_costs import CpuMeter

    def burn() -> None:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
    tree_ms, client_ms, router_ms = CpuMeter(os.getpid()).per_request(burn, 4)
    assert client_ms >= 50.0 and tree_ms >= 40.0  # the kernel's ticks are 10 ms apart
    assert router_ms == 0.0  # no router process in this tree


def test_a_model_that_is_not_there_is_one_line(capsys):
    assert main(["profile", "--model", "/nowhere/model"]) == 2
    assert capsys.readouterr().err.startswith("epd profile: error: ")
