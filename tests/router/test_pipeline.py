"""The router's one request pipeline over a scripted backend, reached through both real front ends
(the official openai client over HTTP, the SDK over gRPC): media, stop strings, detokenization,
admission and deadlines behave the same way whichever front end a request came through."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import openai
import pytest

from epd.client import DeadlineExceeded as SdkDeadlineExceeded
from epd.client import EPDClient
from epd.client import InvalidRequest as SdkInvalidRequest
from epd.config import RouterConfig
from epd.errors import DeadlineExceeded, InvalidRequest, UpstreamError
from epd.models.locate import resolve_model
from epd.router.media_fetch import FetchLimits, MediaFetcher
from epd.router.openai.app import build_app
from epd.router.pipeline import RequestPipeline
from epd.types import ChatRequest, SamplingParams
from tests.client.fakes import RouterServerThread
from tests.conftest import make_image_bytes
from tests.prom import sample_sum
from tests.router.fake_backend import ScriptedBackend
from tests.router.fake_core import send_bytes, serve_app, serve_files

PNG = make_image_bytes(28, 28, seed=5)


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from epd.models.tokenizer_loading import load_tokenizer
    return load_tokenizer(model_dir)


def pieces(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def make_pipeline(model_dir, backend, *, media: MediaFetcher | None = None, **config) -> RequestPipeline:
    return RequestPipeline(model_dir, RouterConfig(model="tiny", **config), backend, media=media)


@contextlib.contextmanager
def both_front_ends(pipeline: RequestPipeline):
    """(openai client over HTTP, SDK client over gRPC), both in front of ``pipeline``."""
    with serve_app(build_app(pipeline, tokenizer=pipeline.tokenizer, generation=pipeline.generation)) as base, \
            RouterServerThread(pipeline, generation=pipeline.generation) as grpc:
        with EPDClient(grpc.address, timeout_s=30) as sdk:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30), sdk


def image_chat(url: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


# ---- stop strings ---------------------------------------------------------------------------------
def test_a_stop_string_truncates_the_output_and_cancels_the_backend_on_both_front_ends(model_dir, tokenizer):
    outputs = pieces(tokenizer, ["Hello", " wor", "ld and", " more"])
    backend = ScriptedBackend(outputs, finish_reason=None, hang_after=3)
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        response = http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                stop="world")
        assert backend.wait_cancelled(5)
        result = sdk.chat("Hi", stop="o w")
    assert response.choices[0].message.content == "Hello " and response.choices[0].finish_reason == "stop"
    # the tokens through the one that completed the stop: what the client would get one token at a
    # time (an output of several tokens is cut there), never those after it
    flat = [t for ids in outputs for t in ids]
    through_stop = next(i + 1 for i in range(len(flat)) if "world" in tokenizer.decode(flat[:i + 1]))
    assert through_stop < sum(len(ids) for ids in outputs[:3])  # the stop came inside the third output
    assert response.usage.completion_tokens == through_stop
    assert result.text == "Hell" and result.finish_reason == "stop" and len(backend.cancelled) == 2


def test_a_stop_string_split_across_streamed_events_is_never_sent(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["Hi, wo", "rld!", " more"]), finish_reason=None, hang_after=2)
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        chunks = list(http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   stream=True, stop=["world", "zzz"]))
        deltas = [d.text for d in sdk.stream("Hi", stop=["world"])]
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(texts) == "Hi, " and not any("wo" in t for t in texts)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(deltas) == "Hi, " and not any("wo" in d for d in deltas)


# ---- detokenization -------------------------------------------------------------------------------
def test_text_is_streamed_without_splitting_a_character(model_dir, tokenizer):
    text = "naïve 你好 🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    backend = ScriptedBackend([[t] for t in ids])
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        deltas = [d.text for d in sdk.stream("Hi")]
        chunks = list(http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   stream=True))
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(deltas) and "" in deltas  # some tokens carried half a character
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


# ---- media, the same for both front ends ----------------------------------------------------------
def test_a_data_url_image_reaches_the_backend_as_its_bytes(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        http.chat.completions.create(model="tiny", messages=image_chat(data_url(PNG)))
        sdk.chat(image_chat(data_url(PNG)))
        sdk.chat("What is this?", images=[PNG])
    assert [[item.data for item in job.prompt.items] for job in backend.jobs] == [[PNG]] * 3
    assert len({tuple(job.prompt.prompt_token_ids) for job in backend.jobs}) == 1


def test_mm_processor_kwargs_size_the_images_from_both_front_ends_and_the_servers_own(model_dir, tokenizer):
    """vLLM's mm_processor_kwargs: the item carries them to the encoder, the placeholder span is
    what they make of the image (the same geometry the encoder's rows must have), and the prefix
    cache's item hash changes with them; the server's --mm-processor-kwargs are the default."""
    from epd.multimodal.geometry import VisionGeometryConfig, image_geometry_from_bytes

    big = make_image_bytes(400, 300, seed=8)
    small = {"min_pixels": 3136, "max_pixels": 112 * 112}
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        http.chat.completions.create(model="tiny", messages=image_chat(data_url(big)))
        http.chat.completions.create(model="tiny", messages=image_chat(data_url(big)),
                                     extra_body={"mm_processor_kwargs": {"max_pixels": 112 * 112}})
        sdk.chat("What is this?", images=[big], mm_processor_kwargs={"max_pixels": 112 * 112})
    plain, *sized = [job.prompt.items[0] for job in backend.jobs]
    expected = image_geometry_from_bytes(big, VisionGeometryConfig(min_pixels=3136, max_pixels=112 * 112))
    assert plain.processor_kwargs is None and plain.num_rows > expected.num_embedding_rows
    for item in sized:
        assert item.processor_kwargs == small and item.num_rows == expected.num_embedding_rows
        assert item.mm_hash != plain.mm_hash  # other rows: other prefix-cache blocks
    assert sized[0].mm_hash == sized[1].mm_hash

    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with both_front_ends(make_pipeline(model_dir, backend, mm_processor_kwargs={"max_pixels": 112 * 112})) as (http, _):
        http.chat.completions.create(model="tiny", messages=image_chat(data_url(big)))
        http.chat.completions.create(model="tiny", messages=image_chat(data_url(big)),
                                     extra_body={"mm_processor_kwargs": {"max_pixels": 200704}})
    server_default, request_own = [job.prompt.items[0] for job in backend.jobs]
    assert server_default.processor_kwargs == small and server_default.num_rows == expected.num_embedding_rows
    assert request_own.processor_kwargs is None and request_own.num_rows == plain.num_rows  # the checkpoint's own


@pytest.mark.parametrize("kwargs,said", [({"max_pixels": 10**8}, "checkpoint's max_pixels"),
                                         ({"num_frames": 8}, "unsupported processor kwargs ['num_frames']"),
                                         ({"max_pixels": "big"}, "whole number of pixels")])
def test_bad_mm_processor_kwargs_are_a_400_naming_the_field_before_the_backend(model_dir, tokenizer, kwargs, said):
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        with pytest.raises(openai.BadRequestError) as err:
            http.chat.completions.create(model="tiny", messages=image_chat(data_url(PNG)),
                                         extra_body={"mm_processor_kwargs": kwargs})
        assert said in err.value.message and err.value.body["param"] == "mm_processor_kwargs"
        if all(isinstance(v, int) for v in kwargs.values()):  # the proto's map holds integers only
            with pytest.raises(SdkInvalidRequest, match="mm_processor_kwargs"):
                sdk.chat("What is this?", images=[PNG], mm_processor_kwargs=kwargs)
    assert backend.jobs == []


def test_videos_arrive_as_video_items_from_every_source_and_front_end(model_dir, tokenizer, tmp_path):
    """A video by data: URL, by http(s) (the same fetcher, guard and limits as images), by file://
    under the allowed root, and from the SDK's videos= (after its images): each a video item of
    the bytes sent, placed in order."""
    from tests.conftest import make_video_bytes

    video = make_video_bytes(num_frames=8, fps=4, seed=60)
    (tmp_path / "clip.mkv").write_bytes(video)
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    media = MediaFetcher(allow_private_network=True, allowed_local_media_path=str(tmp_path))

    def video_chat(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What moves?"}]}]

    with serve_files({"/clip.mkv": send_bytes(video, content_type="video/x-matroska")}) as files, \
            both_front_ends(make_pipeline(model_dir, backend, media=media)) as (http, sdk):
        http.chat.completions.create(model="tiny", messages=video_chat(
            "data:video/x-matroska;base64," + base64.b64encode(video).decode()))
        http.chat.completions.create(model="tiny", messages=video_chat(f"{files}/clip.mkv"))
        http.chat.completions.create(model="tiny", messages=video_chat(f"file://{tmp_path / 'clip.mkv'}"))
        sdk.chat("What moves?", images=[PNG], videos=[video])
    kinds = [[(item.modality, item.data == (video if item.modality == "video" else PNG)) for item in job.prompt.items]
             for job in backend.jobs]
    assert kinds == [[("video", True)]] * 3 + [[("image", True), ("video", True)]]
    assert len({job.prompt.items[-1].mm_hash for job in backend.jobs}) == 1  # one video, one key


def test_a_servers_mm_processor_kwargs_beyond_the_checkpoint_stop_it_at_start(model_dir):
    from epd.config import ConfigError

    with pytest.raises(ConfigError, match="mm_processor_kwargs: .*checkpoint's max_pixels"):
        make_pipeline(model_dir, ScriptedBackend([]), mm_processor_kwargs={"max_pixels": 10**8})


def test_local_files_only_under_the_allowed_root(model_dir, tokenizer, tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    media = MediaFetcher(allowed_local_media_path=str(root))
    with both_front_ends(make_pipeline(model_dir, backend, media=media)) as (http, sdk):
        http.chat.completions.create(model="tiny", messages=image_chat(f"file://{root / 'ok.png'}"))
        with pytest.raises(openai.BadRequestError, match="outside the allowed root"):
            http.chat.completions.create(model="tiny", messages=image_chat(f"file://{tmp_path / 'secret.png'}"))
        with pytest.raises(SdkInvalidRequest, match="outside the allowed root") as info:
            sdk.chat(image_chat(f"file://{tmp_path / 'secret.png'}"))
    assert "messages[0].content[0]" in str(info.value)
    assert [job.prompt.items[0].data for job in backend.jobs] == [PNG]


def test_http_images_come_only_from_public_addresses_unless_allowed(model_dir, tokenizer):
    routes = {"/cat.png": send_bytes(PNG), "/huge.png": send_bytes(PNG + b"\0" * 20000, declare_length=False)}
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with serve_files(routes) as files:
        with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
            with pytest.raises(openai.BadRequestError, match="loopback address; private-network targets"):
                http.chat.completions.create(model="tiny", messages=image_chat(f"{files}/cat.png"))
            with pytest.raises(SdkInvalidRequest, match="loopback address; private-network targets"):
                sdk.chat("What is this?", images=[f"{files}/cat.png"])
        assert backend.jobs == []
        allowing = MediaFetcher(allow_private_network=True, limits=FetchLimits(max_bytes=10000))
        with both_front_ends(make_pipeline(model_dir, backend, media=allowing)) as (http, sdk):
            http.chat.completions.create(model="tiny", messages=image_chat(f"{files}/cat.png"))
            sdk.chat("What is this?", images=[f"{files}/cat.png"])
            with pytest.raises(openai.BadRequestError, match="exceeds the limit of 10000 bytes"):
                http.chat.completions.create(model="tiny", messages=image_chat(f"{files}/huge.png"))
    assert [job.prompt.items[0].data for job in backend.jobs] == [PNG, PNG]


# ---- admission, deadlines, failures -----------------------------------------------------------------
def test_a_request_that_can_never_fit_is_refused_before_the_backend(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    pipeline = make_pipeline(model_dir, backend, max_items_per_request=1, max_model_len=64)
    two_images = [{"role": "user", "content": [{"type": "image", "image": PNG}, {"type": "image", "image": PNG}]}]
    with pytest.raises(InvalidRequest, match=r"2 media items \(images and videos\); the limit is 1 per request"):
        run(pipeline, two_images)
    with pytest.raises(InvalidRequest, match=r"exceeds the model length 64"):
        run(pipeline, [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=60))
    assert backend.jobs == []


def test_a_router_given_no_model_length_admits_by_what_its_engines_take(model_dir, tokenizer):
    """The workers decide their length where they run (on CUDA by default the checkpoint's) and say it
    in their health answers; a router given none follows the smallest, one given a length keeps it."""
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    backend.engine_max_model_len = lambda: 48
    with pytest.raises(InvalidRequest, match=r"exceeds the model length 48"):
        run(make_pipeline(model_dir, backend), [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=44))
    assert make_pipeline(model_dir, backend).max_model_len == 48
    assert make_pipeline(model_dir, backend, max_model_len=8192).max_model_len == 8192
    backend.engine_max_model_len = lambda: 8192  # a longer one than the router's default
    assert make_pipeline(model_dir, backend).max_model_len == 8192
    assert backend.jobs == []


def test_workers_decide_their_model_length_where_they_run(tmp_path):
    """On CUDA an unset max_model_len is the checkpoint's (vLLM's default); given, or on the CPU, as it is."""
    import json

    from epd.config import EngineConfig
    from epd.engine.memory_profile import with_model_len

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 32768}}))
    assert with_model_len(EngineConfig(device="cuda"), tmp_path).max_model_len == 32768
    assert with_model_len(EngineConfig(device="cuda", max_model_len=2048), tmp_path).max_model_len == 2048
    assert with_model_len(EngineConfig(device="cpu"), tmp_path).max_model_len == 4096


def test_no_wait_outlives_the_request_deadline(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["a", "b"]), hang_after=1)
    pipeline = make_pipeline(model_dir, backend)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="timed out"):
        run(pipeline, [{"role": "user", "content": "Hi"}], timeout_s=0.5)
    assert time.monotonic() - start < 5 and backend.cancelled == [backend.jobs[0].request_id]
    with both_front_ends(pipeline) as (_, sdk):
        with pytest.raises(SdkDeadlineExceeded):
            sdk.chat("Hi", timeout_s=0.5)


def test_a_backend_failure_mid_stream_ends_the_request_with_its_error(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["a", "b", "c"]), fail_after=1,
                              error=UpstreamError("decode 127.0.0.1:9 failed the request: gone"))
    pipeline = make_pipeline(model_dir, backend)
    with pytest.raises(UpstreamError, match="decode 127.0.0.1:9"):
        run(pipeline, [{"role": "user", "content": "Hi"}])
    assert sample_sum(pipeline.metrics_text(), "epd_requests_total", outcome="error_502") == 1.0


def run(pipeline: RequestPipeline, messages: list[dict], params: SamplingParams = SamplingParams(),
        timeout_s: float | None = None) -> list:
    async def collect():
        return [e async for e in pipeline.generate(ChatRequest(messages, params, "r-1", timeout_s=timeout_s))]
    return asyncio.run(collect())


def test_an_encoders_bad_image_error_names_every_part_it_concerns_each_with_its_cause():
    """The encoder names images by content hash; the router turns that into parts: two bad images
    each with its own cause, one image sent twice as both its parts."""
    from types import SimpleNamespace

    from epd.errors import UNDECODABLE_MARKER
    from epd.router.pipeline import name_the_part
    part = {"type": "image_url", "image_url": {"url": "data:"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "and"}, part]},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": [part]}]
    prompt = SimpleNamespace(items=[SimpleNamespace(mm_hash=h) for h in ("aaa", "bbb", "aaa")])
    err = InvalidRequest(f"request r: {UNDECODABLE_MARKER} bbb): PNG data is truncated; "
                         f"{UNDECODABLE_MARKER} aaa): not an image (JPEG header, sent as image/png)")
    named = name_the_part(err, prompt, messages)
    assert named.message == ("messages[0].content[2]: PNG data is truncated; messages[0].content[0], "
                             "messages[2].content[0]: not an image (JPEG header, sent as image/png)")
    assert named.param == "messages[0].content[2]"
    other = InvalidRequest("request r: max_tokens must be >= 1")
    assert name_the_part(other, prompt, messages) is other


def test_without_max_tokens_a_request_may_use_what_the_model_length_leaves(model_dir, tokenizer):
    """vLLM's default, on both front ends: max_tokens = max_model_len - prompt tokens; a prompt
    that leaves no room, or a min_tokens beyond the room, is a 400 before the backend is asked."""
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with both_front_ends(make_pipeline(model_dir, backend, max_model_len=300)) as (http, sdk):
        http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
        sdk.chat("Hi")
        http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=7)
        with pytest.raises(openai.BadRequestError, match="leaves no room for output in the model length 300"):
            http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
        with pytest.raises(openai.BadRequestError, match=r"min_tokens \(299\) is more than the \d+ tokens"):
            http.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"min_tokens": 299})
    prompt_len = len(backend.jobs[0].prompt.prompt_token_ids)
    assert [job.sampling.max_tokens for job in backend.jobs] == [300 - prompt_len, 300 - prompt_len, 7]
    assert backend.jobs[1].sampling.temperature == backend.jobs[0].sampling.temperature == 1.0


def test_stop_reason_names_the_stop_string_or_token_and_the_string_can_stay_in_the_text(model_dir, tokenizer):
    outputs = pieces(tokenizer, ["Hello", " world", " END", " more"])
    user = [{"role": "user", "content": "Hi"}]
    with both_front_ends(make_pipeline(model_dir, ScriptedBackend(outputs))) as (http, sdk):
        cut = http.chat.completions.create(model="tiny", messages=user, stop=["END"])
        kept = http.chat.completions.create(model="tiny", messages=user, stop=["END"],
                                            extra_body={"include_stop_str_in_output": True})
        streamed = list(http.chat.completions.create(model="tiny", messages=user, stop=["END"], stream=True))
        by_sdk = sdk.chat("Hi", stop=["END"], include_stop_str_in_output=True)
    assert cut.choices[0].message.content == "Hello world " and cut.choices[0].model_extra["stop_reason"] == "END"
    assert kept.choices[0].message.content == "Hello world END"
    last = streamed[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "END"
    assert by_sdk.text == "Hello world END" and by_sdk.stop_reason == "END"
    last_token = outputs[-1][-1]
    with both_front_ends(make_pipeline(model_dir, ScriptedBackend(outputs, finish_reason="stop"))) as (http, sdk):
        by_token = http.chat.completions.create(model="tiny", messages=user,
                                                extra_body={"stop_token_ids": [last_token]})
        by_eos = http.chat.completions.create(model="tiny", messages=user)
        assert sdk.chat("Hi", stop_token_ids=[last_token]).stop_reason == last_token
    assert by_token.choices[0].model_extra["stop_reason"] == last_token
    assert by_eos.choices[0].finish_reason == "stop" and by_eos.choices[0].model_extra["stop_reason"] is None


def test_the_clients_request_id_is_the_responses(model_dir, tokenizer):
    import httpx
    backend = ScriptedBackend(pieces(tokenizer, ["ok"]))
    with serve_app(build_app(make_pipeline(model_dir, backend), tokenizer=tokenizer)) as base:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
        by_header = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42"})
        by_body = httpx.post(f"{base}/v1/chat/completions", json={**body, "request_id": "mine-7"})
        bad = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": "a b"})
    assert by_header.json()["id"] == "chatcmpl-trace-42" and by_header.headers["x-request-id"] == "trace-42"
    assert by_body.json()["id"] == "chatcmpl-mine-7"
    assert bad.status_code == 400 and "X-Request-Id must be at most 128 printable" in bad.json()["error"]["message"]
    assert backend.jobs[0].request_id.startswith("chatcmpl-trace-42#")  # unique on the workers all the same


def test_structured_output_reaches_the_backend_from_both_front_ends_in_every_spelling(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["{}"]))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    user = [{"role": "user", "content": "Hi"}]
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, sdk):
        http.chat.completions.create(model="tiny", messages=user, response_format=json_schema)
        http.chat.completions.create(model="tiny", messages=user, response_format={"type": "json_object"})
        http.chat.completions.create(model="tiny", messages=user, extra_body={"guided_choice": ["a", "b"]})
        http.chat.completions.create(model="tiny", messages=user, extra_body={"structured_outputs": {"regex": "x+"}})
        http.chat.completions.create(model="tiny", messages=user,
                                     extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
        sdk.chat("Hi", response_format=json_schema)
        sdk.chat("Hi", structured_outputs={"choice": ["a", "b"]})
        with pytest.raises(openai.BadRequestError, match="give one structured output, got response_format and "
                                                         "guided_regex"):
            http.chat.completions.create(model="tiny", messages=user, response_format={"type": "json_object"},
                                         extra_body={"guided_regex": "a"})
        with pytest.raises(openai.BadRequestError, match=r"guided_grammar: .*not valid EBNF: Expected .\)."):
            http.chat.completions.create(model="tiny", messages=user, extra_body={"guided_grammar": "root ::= ("})
        with pytest.raises(SdkInvalidRequest, match="does not compile"):
            sdk.chat("Hi", structured_outputs={"regex": "a("})
    got = [job.sampling.structured for job in backend.jobs]
    assert [(s.kind, json.loads(s.spec) if s.kind in ("json_schema", "choice") else s.spec) for s in got] == [
        ("json_schema", schema), ("json_object", ""), ("choice", ["a", "b"]), ("regex", "x+"),
        ("lark", 'root ::= "yes" | "no"'), ("json_schema", schema), ("choice", ["a", "b"])]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_are_rendered_and_calls_come_back_parsed_whole_and_streamed(model_dir, tokenizer):
    answer = ['Checking.\n<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>']
    backend = ScriptedBackend(pieces(tokenizer, answer))
    user = [{"role": "user", "content": "Weather in Paris?"}]
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, _):
        out = http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL])
        streamed = list(http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL], stream=True))
        plain = http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL], tool_choice="none")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking.\n"
    [streamed_call] = [t for d in deltas for t in (d.tool_calls or [])]
    assert streamed_call.index == 0 and streamed_call.function.name == "get_weather"
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.tool_calls == [] and "<tool_call>" in plain.choices[0].message.content
    rendered = [tokenizer.decode(job.prompt.prompt_token_ids) for job in backend.jobs]
    assert '"name": "get_weather"' in rendered[0] and "<tools>" in rendered[0] and "<tools>" not in rendered[2]


def test_a_tool_round_trip_renders_the_call_and_its_result_into_the_next_prompt(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["Sunny."]))
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, _):
        out = http.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL])
    assert out.choices[0].message.content == "Sunny." and out.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(backend.jobs[0].prompt.prompt_token_ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18C and sunny\n</tool_response>" in prompt


def test_required_and_named_tool_choice_hold_the_output_to_a_grammar(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["x"]))
    user = [{"role": "user", "content": "Weather?"}]
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, _):
        http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL], tool_choice="required")
        http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL],
                                         tool_choice={"type": "function", "function": {"name": "other"}})
        with pytest.raises(openai.BadRequestError, match="already constrains the output"):
            http.chat.completions.create(model="tiny", messages=user, tools=[WEATHER_TOOL], tool_choice="required",
                                         response_format={"type": "json_object"})
    assert [job.sampling.structured.kind for job in backend.jobs] == ["lark", "lark"]
    assert "get_weather" in backend.jobs[1].sampling.structured.spec


def test_the_sdk_calls_tools_and_sends_the_round_trip_back(model_dir, tokenizer):
    answer = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>']
    backend = ScriptedBackend(pieces(tokenizer, answer))
    with both_front_ends(make_pipeline(model_dir, backend)) as (_, sdk):
        result = sdk.chat("Weather in Oslo?", tools=[WEATHER_TOOL], tool_choice="auto")
        [call] = result.tool_calls
        assert result.finish_reason == "tool_calls" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo"} and result.text == ""
        history = [{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "cold"}]
        sdk.chat(history, tools=[WEATHER_TOOL])
        named = {"type": "function", "function": {"name": "get_weather"}}
        sdk.chat("Weather?", tools=[WEATHER_TOOL], tool_choice=named)
    prompt = tokenizer.decode(backend.jobs[1].prompt.prompt_token_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt and "<tool_response>\ncold" in prompt
    assert backend.jobs[2].sampling.structured.kind == "lark"


def test_n_choices_share_one_prompt_and_come_back_indexed_whole_and_streamed(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["Hello", " there"]), finish_reason="length")
    user = [{"role": "user", "content": "Hi"}]
    with both_front_ends(make_pipeline(model_dir, backend)) as (http, _):
        out = http.chat.completions.create(model="tiny", messages=user, n=3, seed=7)
        streamed = list(http.chat.completions.create(model="tiny", messages=user, n=2, stream=True,
                                                     stream_options={"include_usage": True}))
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello there" and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 3 * 2
    assert out.usage.prompt_tokens == len(backend.jobs[0].prompt.prompt_token_ids)
    first_three = backend.jobs[:3]
    assert [job.sampling.seed for job in first_three] == [7, 8, 9]  # choice i draws with seed + i
    assert len({job.request_id for job in first_three}) == 3 and first_three[0].prompt is first_three[2].prompt
    by_index: dict[int, str] = {}
    finishes = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert by_index == {0: "Hello there", 1: "Hello there"} and finishes == {0: "length", 1: "length"}
    assert streamed[-1].usage.completion_tokens == 4


def test_the_sdk_asks_for_n_choices_and_gets_them_all(model_dir, tokenizer):
    backend = ScriptedBackend(pieces(tokenizer, ["A", "B"]), finish_reason="length")
    with both_front_ends(make_pipeline(model_dir, backend)) as (_, sdk):
        result = sdk.chat("Hi", n=3, seed=1, temperature=1.0)
        deltas = list(sdk.stream("Hi", n=2))
    assert [c.index for c in result.choices] == [0, 1, 2] and all(c.text == "AB" for c in result.choices)
    assert result.usage.completion_tokens == 6 and result.text == "AB"
    assert sorted({d.index for d in deltas}) == [0, 1]


def test_a_sync_router_whose_backend_fails_to_start_leaves_no_thread_and_closes_the_backend(model_dir):
    class FailsToStart(ScriptedBackend):
        closed = False

        async def start(self) -> None:
            raise RuntimeError("no worker reachable")

        async def close(self) -> None:
            FailsToStart.closed = True

    import threading

    from epd.router.sync import SyncRouter
    before = {t.ident for t in threading.enumerate() if t.name == "sync-router"}
    with pytest.raises(RuntimeError, match="no worker reachable"):
        SyncRouter(make_pipeline(model_dir, FailsToStart([[1]])))
    assert FailsToStart.closed
    assert not [t for t in threading.enumerate() if t.name == "sync-router" and t.ident not in before]
