"""Real tier processes on 127.0.0.1 driven by the router's own pipeline (the production routing
policies and request order): E -> P, then D over gRPC, tensors as handles (shm / inline). Output
must be token-identical to the in-process engine (itself checked against transformers)."""
from __future__ import annotations

import threading
import time

import pytest

from epd.config import EngineConfig
from epd.llm import LLM
from epd.models.presets import write_preset_checkpoint
from epd.router.routing import Candidate, HashAffinity
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.transport import get_channel
from epd.types import SamplingParams
from epd.v1 import common_pb2, decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2_grpc
from tests.conftest import make_image_bytes, make_video_bytes
from tests.fidelity.reference import ReferenceModel, user_message
from tests.prom import sample_sum, scrape

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=24)
IMG_A, IMG_B, IMG_C = (make_image_bytes(333, 517, seed=21), make_image_bytes(200, 90, seed=22),
                       make_image_bytes(13, 21, seed=23))
CASES = {"0img": [], "1img": [IMG_A], "3img": [IMG_A, IMG_B, IMG_C]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("ckpt") / "m", seed=4321)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), engine_config=EngineConfig(block_size=16))


@pytest.fixture(scope="module", params=["1E1P1D-shm-chunked", "2E1P1D-inline"])
def deployed(request, model_dir):
    two_encoders = request.param.startswith("2E")
    tier_args = {} if two_encoders else {"prefill": ["--max-num-batched-tokens", "13"]}
    with LocalCluster(str(model_dir), num_encoders=2 if two_encoders else 1,
                      transport="inline" if two_encoders else "", tier_args=tier_args) as cluster:
        with SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                     decodes=cluster.decodes, transport="inline" if two_encoders else "") as router:
            yield cluster, router


@pytest.fixture(scope="module")
def driver(deployed):
    return deployed[1]


@pytest.mark.parametrize("case", list(CASES))
def test_cluster_equals_in_process_engine(driver, llm, case):
    messages = user_message("Describe every detail.", CASES[case])
    out = driver.chat(messages, GREEDY)
    expected = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == expected.prompt_token_ids
    assert out.token_ids == expected.token_ids


def test_images_and_videos_in_order_across_the_split(deployed, driver, llm):
    """Videos and images interleaved (one image twice): on 2E1P1D the items spread over both
    encoders; on 1E1P1D a 13-token prefill chunk cuts through each video's span."""
    videos = [make_video_bytes(num_frames=12, fps=4, width=84, height=56, seed=31),
              make_video_bytes(num_frames=6, fps=3, width=56, height=84, seed=32)]
    # no other test's prompt starts like this one, so it warms no prefix they measure
    content = [{"type": "video", "video": videos[0]}, {"type": "image", "image": IMG_C},
               {"type": "video", "video": videos[1]}, {"type": "image", "image": IMG_C},
               {"type": "text", "text": "What happens, in order?"}]
    messages = [{"role": "user", "content": content}]
    out = driver.chat(messages, GREEDY)
    expected = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == expected.prompt_token_ids
    assert out.token_ids == expected.token_ids


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, presence_penalty=1.5, frequency_penalty=0.75, repetition_penalty=1.4),
    SamplingParams(max_tokens=16, temperature=1.0, top_k=40, min_p=0.5, seed=7, frequency_penalty=2.0),
], ids=["greedy-penalised", "seeded-min-p"])
def test_penalties_and_min_p_give_the_in_process_tokens_across_the_split(driver, llm, params):
    """Prefill samples the first token and decode the rest, each over the same token counts."""
    messages = user_message("Describe every detail.", [IMG_A])
    out = driver.chat(messages, params)
    expected = llm.chat(messages, params)[0]
    assert out.token_ids == expected.token_ids
    plain = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                           seed=params.seed)
    assert out.token_ids != llm.chat(messages, plain)[0].token_ids


def test_logit_bias_holds_on_every_tier_that_samples(driver):
    out = driver.chat(user_message("Hi.", []), SamplingParams(max_tokens=6, logit_bias=((1234, 100.0),)))
    assert out.token_ids == [1234] * 6


def test_cluster_equals_transformers(driver, model_dir):
    images = CASES["3img"]
    messages = user_message("Compare the pictures.", images)
    ref = ReferenceModel(model_dir).generate(messages, images, max_new_tokens=24)
    out = driver.chat(messages, GREEDY)
    assert out.prompt_token_ids == ref.prompt_token_ids and out.token_ids == ref.token_ids


def test_second_request_reuses_the_prefix_cache(driver, llm):
    messages = user_message("What colour is most common?", [IMG_B])
    runs = [list(driver.stream(messages, GREEDY)) for _ in range(2)]
    assert runs[1][0].num_cached_tokens > runs[0][0].num_cached_tokens
    tokens = [[t for event in run for t in event.token_ids] for run in runs]
    assert tokens[0] == tokens[1] == llm.chat(messages, GREEDY)[0].token_ids


def test_same_image_in_ten_concurrent_requests_is_encoded_once(driver):
    image = make_image_bytes(90, 60, seed=777)
    before = _encoded_items(driver)
    outputs, errors = [], []

    def one(i):
        try:
            outputs.append(driver.chat(user_message(f"Request {i}.", [image]), SamplingParams(max_tokens=4)))
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(outputs) == 10
    assert _encoded_items(driver) - before == 1


def test_every_tier_counts_its_engines_busy_time_in_its_health_answers(deployed, driver):
    """A worker's health answer carries the seconds its engine has worked (what the router's
    planner reads as utilization): a chat with a new image adds to the encoders', prefill's and
    decode's, each by less than the chat took; the router shows each worker's share of the time
    between two answers, between 0 and 1."""
    cluster, _ = deployed
    stubs = {"encoder": (encoder_pb2_grpc.EncoderStub, cluster.encoders),
             "prefill": (prefill_pb2_grpc.PrefillStub, cluster.prefills),
             "decode": (decode_pb2_grpc.DecodeStub, cluster.decodes)}

    def busy_s() -> dict[str, float]:
        out = {}
        for tier, (stub, addresses) in stubs.items():
            answers = [stub(get_channel(a)).Health(common_pb2.HealthRequest(), timeout=10) for a in addresses]
            assert all(h.HasField("busy_seconds") for h in answers), tier
            out[tier] = sum(h.busy_seconds for h in answers)
        return out

    before, started_s = busy_s(), time.monotonic()
    out = driver.chat(user_message("Describe it.", [make_image_bytes(72, 56, seed=991)]), SamplingParams(max_tokens=8))
    took_s, after = time.monotonic() - started_s, busy_s()
    assert len(out.token_ids) == 8
    for tier in stubs:
        assert 0 < after[tier] - before[tier] < took_s, (tier, before[tier], after[tier], took_s)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the router's checks run once a second
        shares = [w.get("busy") for tier in stubs for w in driver.health()["workers"][tier]]
        if None not in shares:
            break
        time.sleep(0.2)
    assert shares and all(0.0 <= share <= 1.0 for share in shares), shares


def test_a_stream_interval_groups_the_tokens_of_real_workers_and_changes_none(deployed, driver, llm, model_dir):
    """A second router over the same workers with ``stream_interval=4``: the answer with an image is
    token for token the in-process engine's, in events of the first token alone, then 4 tokens each,
    the last with what the finish left; the decode worker sent a frame a group, not one a step."""
    cluster, _ = deployed
    messages = user_message("Describe every detail.", [IMG_A])
    with SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                 decodes=cluster.decodes, stream_interval=4) as grouped:
        events = list(grouped.stream(messages, GREEDY))
        # the decode worker sent a frame for its first token, one a group, and the finish's: not one a step
        frames = sum(link.num_batches for link in grouped.pipeline.backend.decode_links.values())
    assert frames <= 2 + (GREEDY.max_tokens - 1) // 4, frames
    sizes = [len(e.token_ids) for e in events if e.token_ids]
    assert [t for e in events for t in e.token_ids] == llm.chat(messages, GREEDY)[0].token_ids
    assert sizes[0] == 1 and all(n == 4 for n in sizes[1:-1]) and 1 <= sizes[-1] <= 4, sizes
    assert events[-1].finish_reason == "length" and len(sizes) == 1 + -(-(GREEDY.max_tokens - 1) // 4)


def _images_for_every_encoder(driver, llm, seed: int = 100) -> list[bytes]:
    """Images the router's own encoder policy (rendezvous hashing; idle workers: equal load) spreads
    over every encoder; content hashes include the checkpoint path, so they are picked here."""
    policy = HashAffinity()
    idle = [Candidate(address, 0.0) for address in encoders(driver)]
    images, homes = [], set()
    for i in range(40):
        image = make_image_bytes(56 + 8 * (i % 6), 64, seed=seed + i)
        prompt = driver.pipeline.processor.process_messages(*llm.extract_media(user_message("x", [image])))
        images.append(image)
        homes.add(policy.pick(prompt.items[0].mm_hash, idle))
        if len(images) >= 4 and homes == set(encoders(driver)):
            return images
    raise AssertionError("40 images all routed to one encoder")


def test_items_spread_over_encoders_come_back_in_order(driver, llm):
    if len(encoders(driver)) < 2:
        pytest.skip("needs two encoders")
    images = _images_for_every_encoder(driver, llm)
    before = {address: _encoded_items_at(address) for address in encoders(driver)}
    messages = user_message("List them.", images)
    assert driver.chat(messages, GREEDY).token_ids == llm.chat(messages, GREEDY)[0].token_ids
    assert all(_encoded_items_at(address) > before[address] for address in encoders(driver))


def test_an_encoder_lost_mid_call_has_its_items_encoded_by_the_other_one(driver, llm, monkeypatch):
    """Its items join, on the other encoder, the call that encoder already has for the same request
    (one request, two calls there): both are encoded and the answer is unchanged."""
    if len(encoders(driver)) < 2:
        pytest.skip("needs two encoders")
    from epd.router.backends import disaggregated, moves

    images = _images_for_every_encoder(driver, llm, seed=300)
    lost_address, real_unless_lost, lost = encoders(driver)[0], disaggregated.unless_lost, []

    async def lose_the_first_encode_there(worker, awaitable):
        if worker.tier == "encoder" and worker.address == lost_address and not lost:
            lost.append(worker.address)
            awaitable.cancel()  # the call never reaches it: as if it died as the call went out
            raise moves.WorkerLost(moves.lost_message(worker))
        return await real_unless_lost(worker, awaitable)

    monkeypatch.setattr(disaggregated, "unless_lost", lose_the_first_encode_there)
    messages = user_message("List them.", images)
    assert driver.chat(messages, GREEDY).token_ids == llm.chat(messages, GREEDY)[0].token_ids
    assert lost == [lost_address]


def _encoded_items(driver) -> int:
    return sum(_encoded_items_at(address) for address in encoders(driver))


def _encoded_items_at(address: str) -> int:
    health = encoder_pb2_grpc.EncoderStub(get_channel(address)).Health(common_pb2.HealthRequest(), timeout=10)
    return health.num_encoded_items


def encoders(driver: SyncRouter) -> list[str]:
    return list(driver.pipeline.config.encoders)


def test_a_client_leaving_after_the_first_token_frees_its_kv_at_prefill(deployed):
    cluster, router = deployed
    for n in range(3):  # the cut lands before, during or after decode took the KV
        events = router.stream(user_message(f"Tell me everything, take {n}.", [IMG_B]), SamplingParams(max_tokens=24))
        assert next(events).token_ids
        time.sleep(0.05 * n)
        events.close()
    # the KV handles prefill exported for decode are released at once, not when their 60 s TTL ends
    deadline = time.monotonic() + 10
    while _open_leases(cluster, "prefill") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_leases(cluster, "prefill") == 0


def _open_leases(cluster, tier: str) -> float:
    total = 0.0
    for process in cluster.processes:
        if process.tier == tier:
            url = next(f.removeprefix("metrics=") for f in process.ready_fields if f.startswith("metrics="))
            total += sample_sum(scrape(url), "epd_open_leases")
    return total
