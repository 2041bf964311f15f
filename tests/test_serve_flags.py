"""vLLM-named settings of ``epd serve`` and the router: a positional MODEL, a hub id from the local
Hugging Face cache only, --limit-mm-per-prompt in vLLM's JSON (or k=v), --chat-template and per-request
chat_template_kwargs, --allowed-origins (CORS) and --allowed-media-domains."""
from __future__ import annotations

import base64
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest

from epd.config import ConfigError, RouterConfig, load_config
from epd.errors import EPDError
from epd.models.locate import resolve_model
from epd.server.serve import serve_config_from_args


def test_a_positional_model_sets_both_the_router_and_the_workers():
    config = serve_config_from_args(["tiny-qwen2.5-vl", "--port", "0"])
    assert config.router.model == config.worker.model == "tiny-qwen2.5-vl"
    with pytest.raises(ConfigError, match="the model is given twice"):
        serve_config_from_args(["tiny-qwen2.5-vl", "--model", "tiny-qwen2-vl"])


def test_tensor_parallel_sizes_go_to_the_engine_of_each_tier_and_a_bad_one_is_one_line(monkeypatch):
    import torch

    from epd.config import EngineConfig
    from epd.engine.tensor_parallel import TensorParallelConfigError, check_supported

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # as here: a host without a GPU
    from epd.server.serve import _one_rank, _tier_args
    from epd.server.tier import worker_config_from_args

    aggregated = serve_config_from_args(["tiny-qwen2-vl", "--aggregated", "-tp", "2"])
    assert aggregated.router.engine.tensor_parallel_size == 2
    assert serve_config_from_args(["tiny-qwen2-vl", "--tensor-parallel-size", "2", "--aggregated"]) \
        .router.engine.tensor_parallel_size == 2
    # -tp is every engine tier's; --prefill-tp / --decode-tp win; encoders stay whole
    both = serve_config_from_args(["tiny-qwen2-vl", "-tp", "2"])
    assert _tier_args(both) == {"prefill": ["--tensor-parallel-size", "2"], "decode": ["--tensor-parallel-size", "2"]}
    assert _one_rank(both.worker).engine.tensor_parallel_size == 1  # what the encoders (and the file) get
    split = serve_config_from_args(["tiny-qwen2-vl", "--prefill-tp", "2", "--decode-tp", "4"])
    assert _tier_args(split) == {"prefill": ["--tensor-parallel-size", "2"], "decode": ["--tensor-parallel-size", "4"]}
    assert _tier_args(serve_config_from_args(["tiny-qwen2-vl", "-tp", "2", "--decode-tp", "1"])) == \
        {"prefill": ["--tensor-parallel-size", "2"]}
    refusals = [(["--decode-tp", "3"], "--decode-tp 3: num_attention_heads (4) does not divide into 3 tensor-parallel "
                                       "ranks; tiny-qwen2-vl runs at 1, 2, 4"),
                (["--prefill-tp", "2", "--aggregated"], "--prefill-tp with --aggregated, which runs one engine"),
                (["-tp", "2", "--device", "cuda:0"], "sees no CUDA device (CUDA_VISIBLE_DEVICES, driver); use "
                                                     "--device cpu"),
                (["-tp", "2", "--tensor-parallel-devices", "0,1"], "epd serve places each tier's with --prefill-gpus"),
                (["--decode-tp", "3", "--launcher", "ray"], "--decode-tp 3: num_attention_heads (4) does not divide")]
    for flags, expected in refusals:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            serve_config_from_args(["tiny-qwen2-vl", *flags])
    with pytest.raises(ConfigError, match=re.escape("tensor_parallel_size 8: num_attention_heads (4) does not divide")):
        worker_config_from_args("decode", ["--model", "tiny-qwen2-vl", "-tp", "8"])
    assert worker_config_from_args("prefill", ["--model", "tiny-qwen2-vl", "-tp", "2"]).engine.tensor_parallel_size == 2
    with pytest.raises(TensorParallelConfigError, match="sees no CUDA device"):
        check_supported(EngineConfig(tensor_parallel_size=2, device="cuda"))


@pytest.mark.parametrize("model, tp, expected", [("tiny-qwen2-vl", "3", "num_attention_heads (4) does not divide into 3"),
                                                 ("null-qwen2-vl", "2", "its LLM is not cut into ranks")])
def test_a_tensor_parallel_size_the_model_cannot_take_is_one_line_and_exit_2_before_any_rank_starts(
        capsys, model, tp, expected):
    import multiprocessing

    from epd.cli import main

    assert main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "2", "-tp", tp]) == 2
    err = capsys.readouterr().err.strip()  # (a preset's first use may print its checkpoint's progress bar first)
    assert err.splitlines()[-1].startswith("epd generate: error: ") and expected in err.splitlines()[-1], err
    assert "Traceback" not in err and "[rank" not in err, err
    assert not multiprocessing.active_children()


def test_a_flag_setting_configs_with_different_defaults_names_each_default_in_its_help():
    from epd.config import WorkerConfig
    from epd.server.serve import serve_command

    help_text = " ".join(serve_command().parser.format_help().split())
    router_s, worker_s = RouterConfig.model_fields["request_timeout_s"].default, \
        WorkerConfig.model_fields["request_timeout_s"].default
    assert router_s != worker_s
    assert f"(default: {router_s} for router, {worker_s} for worker)" in help_text
    assert "seconds between worker health checks (default: 1.0)" in help_text  # one default: shown once
    config = serve_config_from_args(["tiny-qwen2-vl", "--request-timeout-s", "7"])
    assert config.router.request_timeout_s == config.worker.request_timeout_s == 7


def test_a_hub_id_comes_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants
    snapshot = tmp_path / "models--acme--vl-mini" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--acme--vl-mini" / "refs").mkdir()
    (tmp_path / "models--acme--vl-mini" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("acme/vl-mini") == snapshot
    with pytest.raises(ValueError, match=r"'acme/absent' is not a directory, a preset, or in the local Hugging "
                                         r"Face cache .*\(hf download acme/absent\)"):
        resolve_model("acme/absent")
    assert (Path(sys.executable).parent / "hf").exists()  # the command it names comes with the install


def test_epd_serve_fetches_a_hub_id_once_at_a_revision_and_serves_it_under_its_id(tmp_path, monkeypatch):
    """--revision and --download-dir (vLLM's): the snapshot of that revision in that cache is what
    every process is given; clients still call the model by its id. Not there and not downloadable
    (offline here): one line naming the command that fetches it."""
    import huggingface_hub.constants

    from epd.server.serve import fetch_model
    repo = tmp_path / "models--acme--vl-mini"
    for ref, commit in (("main", "a" * 40), ("v1", "b" * 40)):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    config = fetch_model(serve_config_from_args(["acme/vl-mini", "--revision", "v1", "--download-dir", str(tmp_path)]))
    assert config.router.model == config.worker.model == str(repo / "snapshots" / ("b" * 40))
    assert config.router.served_model_name == config.worker.served_model_name == ("acme/vl-mini",)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"'acme/absent' at v2 is not in the Hugging Face cache .* could not be "
                                          r"downloaded .*\(hf download acme/absent --revision v2 --cache-dir "):
        fetch_model(serve_config_from_args(["acme/absent", "--revision", "v2", "--download-dir", str(tmp_path)]))
    with pytest.raises(ConfigError, match="--revision / --download-dir apply to a hub id"):
        fetch_model(serve_config_from_args(["tiny-qwen2-vl", "--revision", "v1"]))


@pytest.mark.parametrize("value, limits", [('{"image": 3}', {"image": 3}), ("image=5,video=1", {"image": 5, "video": 1}),
                                           ({"image": 2, "video": 0}, {"image": 2, "video": 0})])
def test_limit_mm_per_prompt_takes_vllms_json_or_pairs(value, limits):
    assert load_config(RouterConfig, {"limit_mm_per_prompt": value}).limit_mm_per_prompt == limits


def test_limit_mm_per_prompt_is_checked_per_modality_and_max_items_for_all():
    from epd.router.admission import RequestLimits

    limits = RequestLimits.from_config(load_config(RouterConfig, {"limit_mm_per_prompt": "image=3,video=0",
                                                                  "max_items_per_request": 4}), 8)
    limits.check_num_items({"image": 3})
    with pytest.raises(EPDError, match=r"request has 1 video\(s\); the limit is 0 .*limit_mm_per_prompt video=0"):
        limits.check_num_items({"image": 1, "video": 1})
    with pytest.raises(EPDError, match="request has 4 image"):
        limits.check_num_items({"image": 4})


@pytest.mark.parametrize("value, match", [('{"video": -1}', "counts must be >= 0"),
                                          ("audio=1", "knows image and video"), ("image:3", "key=value pairs")])
def test_limit_mm_per_prompt_refuses_what_it_cannot_do(value, match):
    with pytest.raises(ConfigError, match=match):
        load_config(RouterConfig, {"limit_mm_per_prompt": value})


@pytest.fixture
def app_with(tmp_path):
    from epd.router.openai.app import build_app
    from tests.router.fake_backend import ScriptedBackend
    from tests.router.fake_core import serve_app
    from tests.router.test_pipeline import make_pipeline

    def make(media=None, allowed_origins=(), **config):
        backend = ScriptedBackend([[9707]])
        pipeline = make_pipeline(resolve_model("tiny-qwen2-vl"), backend, media=media, **config)
        return backend, pipeline, serve_app(build_app(pipeline, tokenizer=pipeline.tokenizer,
                                                      allowed_origins=allowed_origins))
    return make


def test_chat_template_override_and_per_request_kwargs(app_with, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>>")
    backend, pipeline, server = app_with(chat_template=str(template))
    with server as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert pipeline.tokenizer.decode(backend.jobs[0].prompt.prompt_token_ids) == "[user]hi>>"
    backend, pipeline, server = app_with()
    from tests.conftest import make_image_bytes
    url = "data:image/png;base64," + base64.b64encode(make_image_bytes(32, 32, seed=1)).decode()
    image_chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with server as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        client.chat.completions.create(model="tiny", messages=image_chat,
                                       extra_body={"chat_template_kwargs": {"add_vision_id": True}})
        with pytest.raises(openai.BadRequestError, match=r"\['add_generation_prompt'\] are set by the server"):
            client.chat.completions.create(model="tiny", messages=image_chat,
                                           extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert "Picture 1: <|vision_start|>" in pipeline.tokenizer.decode(backend.jobs[0].prompt.prompt_token_ids)


def test_cors_answers_only_the_allowed_origins(app_with):
    _, _, server = app_with(allowed_origins=("https://app.example",))
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with server as base:
        allowed = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
        other = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        models = httpx.get(f"{base}/v1/models", headers={"Origin": "https://app.example"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
    assert models.headers["access-control-allow-origin"] == "https://app.example"
    _, _, plain = app_with()
    with plain as base:
        assert "access-control-allow-origin" not in httpx.get(f"{base}/v1/models",
                                                             headers={"Origin": "https://app.example"}).headers


def test_allowed_media_domains_refuse_other_hosts(app_with):
    from epd.router.media_fetch import MediaFetcher
    from tests.conftest import make_image_bytes
    from tests.router.fake_core import send_bytes, serve_files
    image = make_image_bytes(32, 32, seed=2)
    with serve_files({"/a.png": send_bytes(image)}) as files:
        for domains, ok in ((("example.com",), False), (("127.0.0.1",), True)):
            media = MediaFetcher(allow_private_network=True, allowed_media_domains=domains)
            backend, _, server = app_with(media=media)
            with server as base:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
                chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{files}/a.png"}}]}]
                if ok:
                    client.chat.completions.create(model="tiny", messages=chat)
                else:
                    with pytest.raises(openai.BadRequestError, match=r"not among the allowed media domains "
                                                                     r"\(example.com; --allowed-media-domains\)"):
                        client.chat.completions.create(model="tiny", messages=chat)
            assert len(backend.jobs) == (1 if ok else 0)


def test_routers_share_the_http_port_and_vllms_api_server_count_is_the_same_flag():
    assert serve_config_from_args(["tiny-qwen2-vl", "--api-server-count", "3"]).routers == 3
    assert serve_config_from_args(["tiny-qwen2-vl", "--routers", "2"]).routers == 2
    for flags, expected in ((["--aggregated"], "--routers 2 with --aggregated (each router would run its own"),
                            (["--launcher", "ray"], "--routers 2 with the Ray launcher")):
        with pytest.raises(ConfigError, match=re.escape(expected)):
            serve_config_from_args(["tiny-qwen2-vl", "--routers", "2", *flags])
    # what epd serve sets on each of its routers is not a flag of its own
    for flag in ("--http-fd", "--router-index", "--public-grpc"):
        with pytest.raises(ConfigError, match=re.escape(flag)):
            serve_config_from_args(["tiny-qwen2-vl", flag, "1"])
