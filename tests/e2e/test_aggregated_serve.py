"""``epd serve --aggregated`` (the whole model in the router process, the benchmarks' baseline) behind
the same OpenAI API: transformers' greedy output, streaming, admission and a client that leaves."""
from __future__ import annotations

import subprocess

import openai
import pytest

from epd.models.presets import write_preset_checkpoint
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.e2e.test_openai_serve import chat, data_url, metric
from tests.fidelity.reference import ReferenceModel, user_message

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("agg") / "ckpt", seed=1357)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "router.yaml"
    config.write_text("max_model_len: 2048\nmax_items_per_request: 2\n")
    serve = ServeProcess("--aggregated", "--model", str(model_dir), "--served-model-name", "m",
                         "--config", str(config))
    yield serve
    serve.stop_and_check_clean(model_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_no_tier_processes_and_health_says_aggregated(server, model_dir):
    health = _health(server)
    assert health["status"] == "ok" and health["mode"] == "aggregated"
    assert not subprocess.run(["pgrep", "-f", f"epd (encoder|prefill|decode) --model {model_dir}"],
                              capture_output=True).stdout


def test_greedy_output_equals_transformers_and_stream_equals_non_stream(client, model_dir, server):
    image = make_image_bytes(150, 110, seed=4)
    ref = ReferenceModel(model_dir).generate(user_message("What is this?", [image]), [image], max_new_tokens=16)
    out = client.chat.completions.create(model="m", messages=chat("What is this?", [data_url(image)]),
                                         max_tokens=16, temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra.get("token_ids") == ref.token_ids
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model="m", messages=chat("What is this?", [data_url(image)]),
                                            max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content
    assert metric(server, "epd_ttft_seconds_count") >= 2


def test_too_many_images_is_400_naming_the_limit(client):
    image = data_url(make_image_bytes(40, 40, seed=5))
    with pytest.raises(openai.BadRequestError, match="max_items_per_request"):
        client.chat.completions.create(model="m", messages=chat("x", [image] * 3), max_tokens=4)


def _health(server) -> dict:
    import json
    import urllib.request
    return json.loads(urllib.request.urlopen(f"{server.base_url}/health", timeout=10).read())


def test_a_client_leaving_mid_stream_frees_the_engine(client, server):
    # 1900 tokens take the tiny model several seconds to decode; an abort frees it at once
    stream = client.chat.completions.create(model="m", messages=chat("Tell a long story.", []),
                                            max_tokens=1900, temperature=0, stream=True,
                                            extra_body={"min_tokens": 1900})
    next(iter(stream))
    stream.close()
    assert wait_until(lambda: _health(server)["num_running"] == 0, timeout_s=3, period_s=0.05)
    assert metric(server, "epd_router_in_flight") == 0
    out = client.chat.completions.create(model="m", messages=chat("Still there?", []), max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
