import asyncio
from collections import Counter

import pytest

from epd.config import RouterConfig
from epd.errors import EPDError
from epd.router.admission import AdmissionGate, RequestLimits
from epd.router.routing import ROUTING_POLICIES, Candidate
from epd.types import SamplingParams

LIMITS = RequestLimits.from_config(RouterConfig(max_model_len=100, max_items_per_request=2,
                                                encoder_output_budget_bytes=1000, encoder_max_item_tokens=64), 10)


@pytest.mark.parametrize("check,match", [
    (lambda: LIMITS.check_num_items({"image": 2, "video": 1}), "max_items_per_request"),
    (lambda: LIMITS.check_prompt(90, 0, SamplingParams(max_tokens=11)), "101 exceeds the model length 100"),
    (lambda: LIMITS.check_prompt(10, 101, SamplingParams(max_tokens=1)), "encoder output budget is 1000 bytes"),
    (lambda: LIMITS.check_item_tokens([("image", 16), ("image", 80)]), "image 1 needs 80 encoder tokens"),
    (lambda: LIMITS.check_item_tokens([("video", 90)]), "video 0 needs 90 encoder tokens.*lower fps"),
])
def test_never_fitting_requests_name_their_limit(check, match):
    with pytest.raises(EPDError, match=match) as err:
        check()
    assert err.value.http_status == 400


def test_requests_within_limits_pass():
    LIMITS.check_num_items({"image": 1, "video": 1})
    LIMITS.check_prompt(90, 100, SamplingParams(max_tokens=10))
    LIMITS.check_item_tokens([("image", 64), ("video", 64)])


def test_gate_queues_then_refuses_with_retry_after():
    async def scenario():
        gate = AdmissionGate(max_concurrent=1, max_queued=1, queue_timeout_s=0.2)
        async with gate.slot():
            waiter = asyncio.create_task(_enter(gate))
            await asyncio.sleep(0.05)
            with pytest.raises(EPDError) as full:  # the queue (1) is taken: refused at once
                await _enter(gate)
            with pytest.raises(EPDError) as timed_out:
                await waiter
        return full.value, timed_out.value

    full, timed_out = asyncio.run(scenario())
    assert full.http_status == timed_out.http_status == 429 and full.retry_after_s == 0.2
    assert "no slot freed within" in timed_out.message


async def _enter(gate):
    async with gate.slot():
        pass


def test_gate_counts_requests_that_arrive_together_one_by_one():
    async def run():
        gate = AdmissionGate(max_concurrent=2, max_queued=2, queue_timeout_s=5.0)
        release = asyncio.Event()
        outcomes = Counter()

        async def one():
            try:
                async with gate.slot():
                    outcomes["admitted"] += 1
                    await release.wait()
            except EPDError as err:
                outcomes[err.code.http_status] += 1

        tasks = [asyncio.create_task(one()) for _ in range(16)]  # all in one event-loop turn
        await asyncio.sleep(0.05)
        assert (outcomes["admitted"], gate.num_queued, outcomes[429]) == (2, 2, 12)
        release.set()
        await asyncio.gather(*tasks)
        assert outcomes["admitted"] == 4

    asyncio.run(run())


def test_hash_affinity_is_sticky_spreads_keys_and_sheds_load():
    policy = ROUTING_POLICIES.get("hash_affinity")()
    idle = [Candidate(f"w{i}", 0.0) for i in range(3)]
    picks = {f"img{k}": policy.pick(f"img{k}", idle) for k in range(300)}
    assert all(policy.pick(k, idle) == w for k, w in picks.items())  # same key, same worker
    assert min(Counter(picks.values()).values()) > 60  # roughly even
    busy = [Candidate(c.address, 50.0 if c.address == "w0" else 0.0) for c in idle]
    moved = sum(policy.pick(k, busy) != w for k, w in picks.items() if w == "w0")
    assert moved > 0.8 * sum(w == "w0" for w in picks.values())


def test_least_loaded_and_empty_candidates():
    policy = ROUTING_POLICIES.get("least_loaded")()
    assert policy.pick("x", [Candidate("a", 2), Candidate("b", 0.5)]) == "b"
    with pytest.raises(LookupError):
        policy.pick("x", [])
