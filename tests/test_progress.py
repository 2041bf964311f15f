"""Progress while a cluster starts and while weights load (``epd.progress``)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from epd.models.checkpoint import iter_weights
from epd.progress import StartProgress, bar


def test_bar_fills_with_the_fraction_done_and_clamps():
    assert bar(0, 4, width=8) == "[--------]"
    assert bar(1, 4, width=8) == "[##------]"
    assert bar(4, 4, width=8) == "[########]"
    assert bar(9, 4, width=8) == "[########]"
    assert bar(0, 0, width=8) == "[########]"  # nothing to load is done


def test_start_progress_counts_each_ready_process_once_until_the_service_is_up():
    lines, now = [], iter([0.0, 1.5, 3.0, 9.0])
    progress = StartProgress(2, lines.append, clock=lambda: next(now))
    progress.process_ready(SimpleNamespace(tier="prefill", address="127.0.0.1:1"))
    progress.process_ready(SimpleNamespace(tier="router", address="http://127.0.0.1:2"))
    progress.finish()
    progress.process_ready(SimpleNamespace(tier="prefill", address="127.0.0.1:3"))  # a restart: no bar
    assert lines == [
        "epd serve: [##########----------] 1 of 2 processes ready (prefill at 127.0.0.1:1), 1.5 s",
        "epd serve: [####################] 2 of 2 processes ready (router at http://127.0.0.1:2), 3.0 s"]


def test_weights_loading_logs_a_bar_per_shard_by_bytes_read(tmp_path, caplog):
    save_file({"a": torch.zeros(3000)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(1000)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with caplog.at_level(logging.INFO, logger="epd.models"):
        names = [name for name, _ in iter_weights(tmp_path)]
    assert names == ["a", "b"]
    lines = [r.getMessage() for r in caplog.records if "weights" in r.getMessage()]
    assert len(lines) == 3, lines
    assert lines[0].startswith("loading weights: [--------------------] shard 1 of 2")
    assert lines[1].startswith("loading weights: [###############-----] shard 2 of 2")  # 3/4 of the bytes
    assert lines[2].startswith("loaded weights: [####################] 2 shard(s)")
