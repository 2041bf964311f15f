"""The official openai client against ``epd serve`` (router + encoder + prefill + decode processes)."""
from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from typing import Literal

import openai
import pydantic
import pytest

from epd.models.presets import write_preset_checkpoint
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.fake_hub import COMMIT as HUB_COMMIT
from tests.fake_hub import FakeHub
from tests.fidelity.reference import ReferenceModel, user_message
from tests.prom import convention_problems, promtool_problems, sample_sum, scrape
from tests.router.fake_core import send_bytes, serve_files

pytestmark = pytest.mark.slow
HUB_REPO = "qwen-test/tiny-vl"
ROUTER_YAML = """max_model_len: 2048
max_items_per_request: 3
encoder_output_budget_bytes: 32768
max_concurrent_requests: 2
max_queued_requests: 1
queue_timeout_s: 1.0
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("serve") / "ckpt", seed=2468)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def server(model_dir, media_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "router.yaml"
    config.write_text(ROUTER_YAML)
    # the model as a vLLM user names it, a hub id not in the cache: downloaded by epd serve from a
    # stand-in for the Hub's HTTP API on 127.0.0.1 (the Hub is out of reach here) serving model_dir
    downloads = tmp_path_factory.mktemp("downloads")
    with FakeHub(model_dir, HUB_REPO) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        # vLLM users' habits on the command line: accepted flags (said once each) beside ours
        serve = ServeProcess(HUB_REPO, "--download-dir", str(downloads), "--revision", "main",
                             "--served-model-name", "m",
                             "--allowed-local-media-path", str(media_dir),
                             "--config", str(config), "--allow-private-network",  # http images from a loopback server
                             "--trust-remote-code", "--disable-log-requests", "--kv-cache-dtype", "auto",
                             "--dtype", "float",
                             # decode steps launched before the last one's tokens are known: every
                             # answer below still equals transformers
                             "--async-scheduling", env=env)
    serve.hub_requests, serve.snapshot = hub.requests, downloads / f"models--{HUB_REPO.replace('/', '--')}" / \
        "snapshots" / HUB_COMMIT
    yield serve
    serve.stop_and_check_clean(serve.snapshot)


def test_a_hub_id_not_in_the_cache_is_downloaded_once_into_the_download_dir(server, model_dir):
    """Every file of the checkpoint, fetched once (the workers read the snapshot), with
    huggingface_hub's progress bar; the answers below are the checkpoint's own (equal transformers)."""
    assert sorted(p.name for p in server.snapshot.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    downloads = [path for method, path in server.hub_requests if method == "GET" and "/resolve/" in path]
    assert len(downloads) == len(list(model_dir.iterdir()))
    assert any("Fetching" in line for line in server.lines), server.lines[:20]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat(text: str, urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def metric(server, name: str, **labels: str) -> float:
    return sample_sum(scrape(f"{server.base_url}/metrics"), name, **labels)


def test_a_vllm_command_line_runs_and_says_what_each_accepted_flag_changes(server):
    said = [line for line in server.lines if "is vLLM's; accepted" in line]
    assert [line.split()[2] for line in said] == ["--trust-remote-code", "--disable-log-requests",
                                                   "--kv-cache-dtype"], said


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["m"]  # --served-model-name
    assert urllib.request.urlopen(f"{server.base_url}/health", timeout=10).status == 200


def test_a_model_that_is_not_served_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="the model 'tiny-qwen2-vl' does not exist"):
        client.chat.completions.create(model="tiny-qwen2-vl", messages=chat("x", []), max_tokens=2)


def test_greedy_output_equals_transformers_by_data_url_and_stream(client, model_dir):
    image = make_image_bytes(160, 120, seed=1)
    ref = ReferenceModel(model_dir).generate(user_message("What is this?", [image]), [image], max_new_tokens=20)
    out = client.chat.completions.create(model="m", messages=chat("What is this?", [data_url(image)]),
                                         max_tokens=20, temperature=0, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra.get("token_ids") == ref.token_ids or \
        getattr(out.choices[0], "token_ids", None) == ref.token_ids
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == 20
    stream = client.chat.completions.create(model="m", messages=chat("What is this?", [data_url(image)]),
                                            max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_mm_processor_kwargs_across_the_split_equal_transformers_and_key_the_encoder_cache(client, server, model_dir):
    image = make_image_bytes(160, 120, seed=12)
    kwargs = {"max_pixels": 56 * 56 * 2}
    ref = ReferenceModel(model_dir).generate(user_message("What is this?", [image]), [image], max_new_tokens=16,
                                             processor_kwargs=kwargs)

    def ask(extra: dict):
        return client.chat.completions.create(model="m", messages=chat("What is this?", [data_url(image)]),
                                              max_tokens=16, temperature=0, extra_body={"return_token_ids": True,
                                                                                        **extra})

    def encoded_after_refresh() -> float:
        time.sleep(1.5)  # the cluster view refreshes from health checks every second
        return metric(server, "epd_encoder_encoded_items_total")

    out = ask({"mm_processor_kwargs": kwargs})
    assert out.choices[0].model_extra.get("token_ids") == ref.token_ids
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    encoded = encoded_after_refresh()
    ask({"mm_processor_kwargs": kwargs})
    assert encoded_after_refresh() == encoded  # the same image and kwargs: an encoder-cache hit
    plain = ask({})
    assert encoded_after_refresh() == encoded + 1  # other kwargs, other rows: a miss
    assert plain.usage.prompt_tokens > out.usage.prompt_tokens


def test_a_video_url_across_the_split_equals_transformers_and_a_repeat_encodes_nothing(client, server, model_dir):
    """vLLM's video_url part through every tier; the same video again is an encoder-cache hit, the
    same video at another fps a miss."""
    from epd.models.qwen2_vl.vision import QwenVisionEncoder
    from epd.multimodal.media import MediaInput
    from epd.multimodal.video import video_geometry_from_bytes
    from tests.conftest import make_video_bytes

    video = make_video_bytes(num_frames=12, fps=4, width=112, height=84, seed=21)
    url = "data:video/x-matroska;base64," + base64.b64encode(video).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What moves?"}]}]
    vision = QwenVisionEncoder(model_dir)
    pixels, grid = vision.preprocess([MediaInput(video, "video")])
    seconds = video_geometry_from_bytes(video, vision.video_sampling).second_per_grid_t
    ref = ReferenceModel(model_dir).generate_with_videos(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}], [],
        [(pixels, grid, seconds)], max_new_tokens=16)

    def ask(extra: dict):
        return client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0,
                                              extra_body={"return_token_ids": True, **extra})

    def encoded_after_refresh() -> float:
        time.sleep(1.5)  # the cluster view refreshes from health checks every second
        return metric(server, "epd_encoder_encoded_items_total")

    out = ask({})
    assert out.choices[0].model_extra.get("token_ids") == ref.token_ids
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    encoded = encoded_after_refresh()
    again = ask({})
    assert encoded_after_refresh() == encoded and again.choices[0].message.content == out.choices[0].message.content
    faster = ask({"mm_processor_kwargs": {"fps": 4}})  # twice the frames: other rows, a miss
    assert encoded_after_refresh() == encoded + 1 and faster.usage.prompt_tokens > out.usage.prompt_tokens


def test_image_by_file_path_and_outside_root_refused(client, media_dir, tmp_path):
    image = make_image_bytes(90, 70, seed=3)
    (media_dir / "pic.png").write_bytes(image)
    by_path = client.chat.completions.create(model="m", messages=chat("Describe.", [f"file://{media_dir}/pic.png"]),
                                             max_tokens=8, temperature=0)
    by_data = client.chat.completions.create(model="m", messages=chat("Describe.", [data_url(image)]),
                                             max_tokens=8, temperature=0)
    assert by_path.choices[0].message.content == by_data.choices[0].message.content
    (tmp_path / "outside.png").write_bytes(image)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=chat("x", [f"file://{tmp_path}/outside.png"]), max_tokens=4)


def test_same_image_twice_is_an_encoder_cache_hit(client, server):
    image = data_url(make_image_bytes(100, 80, seed=9))
    client.chat.completions.create(model="m", messages=chat("First.", [image]), max_tokens=4)
    time.sleep(1.5)  # the cluster view refreshes from health checks every second
    encoded = metric(server, "epd_encoder_encoded_items_total")
    client.chat.completions.create(model="m", messages=chat("Second.", [image]), max_tokens=4)
    time.sleep(1.5)  # the cluster view refreshes from health checks every second
    assert metric(server, "epd_encoder_encoded_items_total") == encoded
    assert metric(server, "epd_requests_total", outcome="ok") >= 2


def test_every_process_serves_metrics_by_prometheus_conventions(client, server):
    """The router's and each worker's own /metrics: counters _total, base units, process metrics,
    and one model_name label (the served name, on the workers too)."""
    client.chat.completions.create(model="m", messages=chat("Hi.", []), max_tokens=2)
    assert len(server.worker_metrics_urls) == 3, server.lines[-12:]
    for url in [f"{server.base_url}/metrics", *server.worker_metrics_urls]:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        assert convention_problems(text, model_name="m") == [], url
        assert promtool_problems(text) == [], url
    assert metric(server, "epd_requests_total", model_name="m") >= 1
    # vLLM's names beside ours, the same values (what dashboards and autoscalers written for vLLM read)
    router = scrape(f"{server.base_url}/metrics")
    for ours, theirs in (("epd_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("epd_output_tokens_total", "vllm:generation_tokens_total"),
                         ("epd_ttft_seconds_count", "vllm:time_to_first_token_seconds_count")):
        assert sample_sum(router, theirs, model_name="m") == sample_sum(router, ours, model_name="m") > 0, theirs
    workers = [scrape(url) for url in server.worker_metrics_urls]
    engines = [text for text in workers if "epd_running_requests" in text]
    assert len(engines) == 2  # prefill and decode
    for text in engines:
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries_total"):
            sample_sum(text, name, model_name="m")  # declared (KeyError otherwise)
    assert sum(sample_sum(t, "vllm:prefix_cache_queries_total", model_name="m") for t in engines) > 0
    # --async-scheduling: decode overlapped its steps; prefill steps in order (one token a request)
    overlapped = sorted(sample_sum(t, "epd_engine_overlapped_steps_total", model_name="m") for t in engines)
    assert overlapped[0] == 0 and overlapped[1] > 0, overlapped


@pytest.mark.parametrize("case,expected", [
    ("too_many_items", "max_items_per_request"), ("too_long", "exceeds the model length"),
    ("too_many_rows", "encoder output budget"), ("n17", "n must be in [1, 16]"),
])
def test_requests_that_can_never_fit_get_400_naming_the_limit(client, case, expected):
    small = data_url(make_image_bytes(30, 30, seed=4))
    kwargs = dict(model="m", max_tokens=4, messages=chat("x", [small]))
    if case == "too_many_items":
        kwargs["messages"] = chat("x", [small] * 4)
    elif case == "too_long":
        kwargs["max_tokens"] = 2040
    elif case == "too_many_rows":
        kwargs["messages"] = chat("x", [data_url(make_image_bytes(448, 448, seed=5))])
    else:
        kwargs["n"] = 17  # past MAX_CHOICES (n itself works: test_n_choices_across_the_split_share_the_prefill)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs)
    assert expected in str(err.value)


def test_saturation_gives_429_with_retry_after(client, server):
    slow = dict(model="m", messages=chat("Long story.", []), max_tokens=1500, temperature=0)
    statuses = []

    def one():
        try:
            client.chat.completions.create(**slow)
            statuses.append(200)
        except openai.RateLimitError as err:
            statuses.append((429, err.response.headers.get("retry-after")))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    rejected = [s for s in statuses if s != 200]
    assert rejected and all(s[1] and int(s[1]) >= 1 for s in rejected)
    assert metric(server, "epd_admission_rejections_total", reason="saturated") >= len(rejected)


def test_client_disconnect_mid_stream_frees_the_request_everywhere(client, server):
    stream = client.chat.completions.create(model="m", messages=chat("Go on forever.", []), max_tokens=1800,
                                            temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()

    def all_idle() -> bool:
        health = json.loads(urllib.request.urlopen(f"{server.base_url}/health", timeout=10).read())
        workers = [w for tier in health["workers"].values() for w in tier]
        return all(w["running"] == 0 and w["waiting"] == 0 and w["in_flight"] == 0 for w in workers)

    assert wait_until(all_idle, timeout_s=20), "the aborted request kept running on some tier"


def test_sdk_sync_and_async_against_the_real_cluster(client, server, media_dir):
    import asyncio

    from epd.client import AsyncEPDClient, EPDClient

    image = make_image_bytes(80, 60, seed=12)
    (media_dir / "sdk.png").write_bytes(image)
    via_http = client.chat.completions.create(model="m", messages=chat("Name it.", [data_url(image)]),
                                              max_tokens=12, temperature=0)
    with EPDClient(server.grpc_address, timeout_s=120) as sdk:
        result = sdk.chat("Name it.", images=[str(media_dir / "sdk.png")], max_tokens=12, temperature=0)
    assert result.text == via_http.choices[0].message.content and len(result.token_ids) == 12

    async def streamed() -> str:
        async with AsyncEPDClient(server.grpc_address, timeout_s=120) as sdk:
            stream = sdk.stream("Name it.", images=[image], max_tokens=12, temperature=0)
            return "".join([d.text async for d in stream])

    assert asyncio.run(streamed()) == result.text


def test_sdk_and_public_grpc_take_an_http_image_like_a_data_url(client, server):
    """Media are resolved by the router's one pipeline, so an http(s) image works through the public
    gRPC API and the SDK exactly as through HTTP."""
    import grpc

    from epd.client import EPDClient
    from epd.v1 import common_pb2, router_pb2, router_pb2_grpc

    image = make_image_bytes(96, 64, seed=31)
    with serve_files({"/pic.png": send_bytes(image)}) as files:
        url = f"{files}/pic.png"
        with EPDClient(server.grpc_address, timeout_s=120) as sdk:
            by_url = sdk.chat("Describe it.", images=[url], max_tokens=12, temperature=0)
            by_data = sdk.chat("Describe it.", images=[data_url(image)], max_tokens=12, temperature=0)
        request = router_pb2.ChatGenerateRequest(
            messages=[router_pb2.ChatMessage(role="user", content=[
                router_pb2.ContentPart(image_url=url), router_pb2.ContentPart(text="Describe it.")])],
            sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0))
        with grpc.insecure_channel(server.grpc_address) as channel:
            raw = [t for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120) for t in r.token_ids]
        via_http = client.chat.completions.create(model="m", messages=chat("Describe it.", [url]), max_tokens=12,
                                                  temperature=0, extra_body={"return_token_ids": True})
    assert len(by_data.token_ids) == 12 and by_url.token_ids == by_data.token_ids == raw
    assert by_url.prompt_token_ids == by_data.prompt_token_ids
    assert via_http.choices[0].model_extra.get("token_ids") == by_data.token_ids


def test_an_image_that_does_not_decode_is_a_400_naming_it_and_the_server_keeps_serving(client):
    image = make_image_bytes(160, 120, seed=9)
    truncated = image[: len(image) // 2]  # a valid header: the router's size check passes, the encoder's decode fails
    named = r"^Error code: 400 - messages\[0\]\.content\[0\]: PNG data is truncated or corrupt"
    with pytest.raises(openai.BadRequestError, match=named):
        client.chat.completions.create(model="m", messages=chat("What is it?", [data_url(truncated)]), max_tokens=2)
    out = client.chat.completions.create(model="m", messages=chat("What is it?", [data_url(image)]), max_tokens=2)
    assert out.choices[0].finish_reason == "length"


class _Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    colour: Literal["red", "green", "blue"]
    ok: bool


def test_parse_with_a_pydantic_model_gives_an_instance_across_the_split(client):
    """The official client's structured-output helper: prefill samples the first token under the
    grammar and decode the rest, each with its own matcher over the same tokens."""
    image = make_image_bytes(64, 48, seed=41)
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        out = client.chat.completions.parse(model="m", messages=chat("Who is in the picture?", [data_url(image)]),
                                            response_format=_Person, max_tokens=120, **params)
        assert isinstance(out.choices[0].message.parsed, _Person), out.choices[0].message.content
    streamed = client.chat.completions.create(
        model="m", messages=chat("Pick one.", []), stream=True, max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in {"alpha", "beta", "gamma"}
    with pytest.raises(openai.BadRequestError, match=r"guided_regex: structured output \(regex\) does not compile"):
        client.chat.completions.create(model="m", messages=chat("x", []), extra_body={"guided_regex": "a("})


_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}}}}}


def test_a_tool_round_trip_with_the_official_client_across_the_split(client):
    """tool_choice required: the random model's call is held to the tool's schema, so it is always
    valid; the call and its result then go back in the history and the next answer comes."""
    import jsonschema
    messages = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[_WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=1.0, seed=5)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls[:1]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _WEATHER["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[_WEATHER], max_tokens=8)
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    streamed = list(client.chat.completions.create(
        model="m", messages=messages[:1], tools=[_WEATHER], stream=True, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False))
    calls = [t for c in streamed if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), _WEATHER["function"]["parameters"])


def test_completions_and_tokenize_against_the_real_cluster(client, server):
    out = client.completions.create(model="m", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    image = make_image_bytes(80, 64, seed=44)
    messages = chat("Describe it.", [data_url(image)])
    counted = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{server.base_url}/tokenize", data=json.dumps({"model": "m", "messages": messages}).encode(),
        headers={"Content-Type": "application/json"}), timeout=60).read())
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert counted["count"] == answer.usage.prompt_tokens


def test_n_choices_across_the_split_share_the_prefill(client, server):
    image = make_image_bytes(72, 56, seed=45)
    messages = chat("Describe it.", [data_url(image)])
    out = client.chat.completions.create(model="m", messages=messages, n=3, max_tokens=8, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 24
    assert len({c.message.content for c in out.choices}) > 1  # seed + i: three different draws
    again = client.chat.completions.create(model="m", messages=messages, n=3, max_tokens=8, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
