"""``epd serve ORG/NAME --download-dir D`` as a vLLM user types it, for a model not in the cache:
downloaded once before any process starts (from a hub on 127.0.0.1 serving a real checkpoint, the
hub being out of reach here), with huggingface_hub's progress bar, into ``D``; served under the hub
id, answering as the same checkpoint does in-process, token for token."""
from __future__ import annotations

import os

import httpx
import pytest

from epd.models.presets import write_preset_checkpoint
from tests.e2e.serve_process import ServeProcess
from tests.fake_hub import COMMIT, FakeHub

pytestmark = pytest.mark.slow
REPO = "qwen-test/tiny-vl"


def test_a_hub_id_not_in_the_cache_is_downloaded_once_and_served_under_its_name(tmp_path):
    checkpoint = write_preset_checkpoint("tiny-qwen2-vl", tmp_path / "hub" / "repo", seed=97)
    cache = tmp_path / "downloads"
    with FakeHub(checkpoint, REPO) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_DISABLE_XET": "1"}
        serve = ServeProcess(REPO, "--download-dir", str(cache), "--revision", "main", env=env)
        try:
            body = {"model": REPO, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            reply = httpx.post(f"{serve.base_url}/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            tokens = reply.json()["choices"][0]["token_ids"]
        finally:
            assert serve.stop() == 0, "\n".join(serve.lines[-30:])
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert sorted(os.listdir(snapshot)) == sorted(os.listdir(checkpoint))  # every file, into --download-dir
    downloads = [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]
    assert len(downloads) == len(os.listdir(checkpoint))  # each file once: the workers read the snapshot
    assert any("Fetching" in line for line in serve.lines), serve.lines[:20]  # the progress bar
    from epd.llm import LLM
    from epd.types import SamplingParams

    with LLM(str(checkpoint)) as llm:
        expected = llm.chat([{"role": "user", "content": "Say hello."}],
                            SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert tokens == expected
