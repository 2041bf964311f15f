"""The ``epd`` command as a user runs it: real subprocesses, a checkpoint directory on disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import make_image_bytes
from tests.fidelity.reference import ReferenceModel, user_message


def epd(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ})


@pytest.mark.slow
def test_generate_json_on_an_exported_checkpoint_gives_transformers_greedy_ids(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = epd("export-preset", "tiny-qwen2.5-vl", str(ckpt), "--seed", "77")
    assert done.returncode == 0, done.stderr
    image = make_image_bytes(150, 100, seed=5)
    (tmp_path / "img.png").write_bytes(image)
    done = epd("generate", "--model", str(ckpt), "--prompt", "What is shown?", "--image",
               str(tmp_path / "img.png"), "--max-tokens", "24", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ref = ReferenceModel(ckpt).generate(user_message("What is shown?", [image]), [image], max_new_tokens=24)
    assert out["prompt_token_ids"] == ref.prompt_token_ids
    assert out["token_ids"] == ref.token_ids
    assert isinstance(out["text"], str) and out["text"]


@pytest.mark.slow
def test_generate_takes_images_and_videos_in_command_line_order(tmp_path):
    """--image and --video in the order given; a video alone equals epd.LLM with the same part."""
    from epd.llm import LLM
    from epd.types import SamplingParams
    from tests.conftest import make_video_bytes

    video, image = make_video_bytes(num_frames=8, fps=4, seed=9), make_image_bytes(60, 40, seed=9)
    (tmp_path / "clip.mkv").write_bytes(video)
    (tmp_path / "img.png").write_bytes(image)
    done = epd("generate", "--prompt", "What happens?", "--video", str(tmp_path / "clip.mkv"), "--image",
               str(tmp_path / "img.png"), "--max-tokens", "8", "--json", "--mm-processor-kwargs", '{"fps": 4}')
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    llm = LLM("tiny-qwen2-vl")
    ids = out["prompt_token_ids"]
    video_id, image_id = llm.mm_spec.video_token_id, llm.mm_spec.image_token_id
    assert ids.index(video_id) < ids.index(image_id)  # the order of the flags
    expected = llm.chat([{"role": "user", "content": [{"type": "video", "video": video}, {"type": "image", "image": image},
                                                      {"type": "text", "text": "What happens?"}]}],
                        SamplingParams(max_tokens=8), mm_processor_kwargs={"fps": 4})[0]
    assert out["token_ids"] == expected.token_ids and ids == expected.prompt_token_ids
    assert ids.count(video_id) == 4 * 2 * 3  # 8 frames at 4 fps: 4 temporal patches of 2x3 merged cells (84x56)


def test_generate_reports_a_missing_model_clearly(tmp_path):
    done = epd("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert done.returncode == 2
    assert "neither a directory nor a preset" in done.stderr


def test_generate_refuses_a_non_image_file(tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    done = epd("generate", "--prompt", "hi", "--image", str(bad))
    assert done.returncode == 2
    assert "image" in done.stderr.lower()


def test_generate_takes_the_engines_device_and_dtype_flags():
    done = epd("generate", "--prompt", "hi", "--max-tokens", "3", "--device", "cpu", "--dtype", "bfloat16",
               "--max-model-len", "512", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout.strip().splitlines()[-1])["token_ids"]) == 3
    done = epd("generate", "--prompt", "hi", "--dtype", "int8")
    assert done.returncode == 2 and "\n" not in done.stderr.strip()
    assert "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16', got 'int8'" in done.stderr


def test_a_started_program_serves_with_its_heap_frozen_and_fewer_young_collections():
    """At its ready line a program's loaded objects are frozen out of the collector's reach and the
    youngest generation is collected less often (``epd.heap.settle_for_serving``); a caller that goes
    on (this test's own process) keeps its collector as it was."""
    import gc

    from epd import heap
    from epd.server import process

    before = gc.get_threshold(), gc.get_freeze_count()
    process.announce_ready("test", "here")
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    probe = ("import gc; from epd import heap; from epd.server import process; heap.own(); "
             "process.announce_ready('x', 'y'); print(gc.get_threshold()[0], gc.get_freeze_count())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    ready, settled = done.stdout.strip().splitlines()
    assert ready == "EPD_READY x y"
    threshold, frozen = map(int, settled.split())
    assert threshold == heap.YOUNG_COLLECTION_OBJECTS and frozen > 1000


def test_only_the_program_freezes_its_objects_for_its_exit(monkeypatch, capsys):
    """``epd`` as a program freezes what it allocated before it exits (its teardown would walk
    torch's objects for a second); a caller that goes on (a test, a script) keeps its objects."""
    from epd import cli

    frozen, owned = [], []
    monkeypatch.setattr("epd.heap.freeze_for_exit", lambda: frozen.append(True))
    monkeypatch.setattr("epd.heap.own", lambda: owned.append(True))
    bad = ["generate", "--prompt", "hi", "--dtype", "int8"]
    assert cli.main(bad) == 2 and frozen == [] and owned == []
    monkeypatch.setattr("sys.argv", ["epd", *bad])
    assert cli.main() == 2 and frozen == [True] and owned == [True]
    assert "got 'int8'" in capsys.readouterr().err
