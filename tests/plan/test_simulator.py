"""The cluster simulator (``epd.plan``) against what queueing theory and EPD's own rules say, on
made-up stage costs: a single encoder under Poisson load waits as an M/D/1 queue does (the test
fails when the simulator's queueing is taken out); workers sharing cores slow each other down and
devices of their own do not; a repeated image is encoded once; continuous batching costs a step
more as the batch grows; prefill is chunked; the figures a planner ranks by come out."""
from __future__ import annotations

import dataclasses
import random

import pytest

from epd.plan.costs import StageCosts, interpolate
from epd.plan.simulate import Topology, simulate
from epd.plan.tiers import SimRequest, SimSettings

FREE = SimSettings(router_ms_per_request=0.0, router_ms_per_token=0.0)


def costs(encoder_ms: float = 10.0, prefill_ms_per_token: float = 0.0, decode_ms: float = 0.0,
          decode_ms_per_seq: float = 0.0) -> StageCosts:
    return StageCosts(
        model="made-up", device="cpu", threads=1,
        encoder=((100.0, 1, encoder_ms), (100.0, 8, encoder_ms)),
        prefill_cold=((0.0, 0.0), (1000.0, 1000 * prefill_ms_per_token)), prefill_cached=(),
        decode=((1, 100, decode_ms + decode_ms_per_seq), (64, 100, decode_ms + 64 * decode_ms_per_seq)),
        transfer={"shm": ((1.0, 0.0), (2.0, 0.0))})


def path_costs(**fields) -> StageCosts:
    """The made-up stages the serving path's figures are derived against: a 448-pixel image 20 ms,
    a 100-token prefill 10, a decode step 3 ms at batch 1 and 6 at 4, shared memory 1 ms a MB, the
    router's work 1 ms a request; ``fields`` replace any of them."""
    return StageCosts(**{"model": "made-up", "device": "cpu", "threads": 1, "encoder": ((448.0 ** 2, 1, 20.0),),
                         "prefill_cold": ((0.0, 0.0), (100.0, 10.0)), "prefill_cached": (),
                         "decode": ((1, 100, 3.0), (4, 100, 6.0)), "transfer": {"shm": ((1.0, 1.0),)},
                         "router": ((0.0, 1.0), (448.0 ** 2, 1.0)), **fields})


def split_of(request_ms: float, image_ms: float, token_ms: float) -> dict:
    """A part's CPU beyond the stages as ``derive`` splits it, to compare with."""
    return {"request_ms": pytest.approx(request_ms), "image_ms": pytest.approx(image_ms),
            "token_ms": pytest.approx(token_ms)}


def poisson(n: int, rate_per_s: float, seed: int = 0, images: int = 1, output: int = 1) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate_per_s) * 1000.0
        out.append(SimRequest(i, t, 16, output, tuple((i * 10 + k, 100.0, 4) for k in range(images))))
    return out


def test_one_encoder_under_poisson_load_waits_as_an_m_d_1_queue():
    """Service 10 ms, arrivals at 70/s (load 0.7): the mean wait is rho / (2 mu (1 - rho)) = 11.7 ms,
    so the mean TTFT is 21.7 ms; without queueing it would be the 10 ms service alone."""
    service_ms, rate, n = 10.0, 70.0, 4000
    one_at_a_time = SimSettings(router_ms_per_request=0.0, router_ms_per_token=0.0, encoder_batch_size=1)
    result = simulate(costs(encoder_ms=service_ms), Topology(cores=None), poisson(n, rate), one_at_a_time)
    rho = rate * service_ms / 1000.0
    expected_ms = service_ms + rho * service_ms / (2 * (1 - rho))
    mean_ttft = sum(r.ttft_ms for r in result.requests) / n
    assert expected_ms * 0.92 < mean_ttft < expected_ms * 1.08, (mean_ttft, expected_ms)
    assert result.utilization["encoder"] == pytest.approx(rho, rel=0.1)


def test_workers_sharing_cores_slow_each_other_and_devices_of_their_own_do_not():
    """Two requests at once with 10 ms of encoder and 10 ms of prefill each: on 1 core the tiers'
    work overlaps and shares it; with a device each, the second request's encode overlaps the first
    one's prefill at full speed."""
    c = costs(encoder_ms=10.0, prefill_ms_per_token=10.0 / 16)
    requests = lambda: [SimRequest(0, 0.0, 16, 1, ((1, 100.0, 4),)), SimRequest(1, 0.0, 16, 1, ((2, 100.0, 4),))]
    own = simulate(c, Topology(cores=None), requests(), FREE)
    shared = simulate(c, Topology(cores=1), requests(), FREE)
    assert [round(r.ttft_ms, 3) for r in own.requests] == [20.0, 30.0]  # encoded as one batch of two
    assert max(r.ttft_ms for r in shared.requests) == pytest.approx(40.0)  # 40 ms of work on one core
    gpu_sharing = simulate(c, Topology(cores=None, workers_per_device=3), requests(), FREE)
    assert max(r.ttft_ms for r in gpu_sharing.requests) == pytest.approx(40.0)  # one device for all three


def test_a_repeated_image_is_encoded_once_and_waited_for_while_it_is_being_encoded():
    same = ((7, 100.0, 4),)
    requests = [SimRequest(i, float(i), 16, 1, same) for i in range(5)]
    result = simulate(costs(encoder_ms=10.0), Topology(cores=None), requests, FREE)
    assert [round(r.ttft_ms) for r in result.requests] == [10, 9, 8, 7, 6]  # all wait for the one encode
    assert result.utilization["encoder"] * result.duration_ms == pytest.approx(10.0)


def test_a_decode_step_costs_more_as_the_batch_grows_and_each_request_gets_one_token_a_step():
    c = costs(encoder_ms=0.0, decode_ms=2.0, decode_ms_per_seq=0.5)
    alone = simulate(c, Topology(cores=None), [SimRequest(0, 0.0, 16, 11)], FREE)
    crowd = simulate(c, Topology(cores=None), [SimRequest(i, 0.0, 16, 11) for i in range(16)], FREE)
    assert alone.requests[0].tpot_ms == pytest.approx(2.5)
    # the first request's step was running when the others' KV came: they join the next one; the
    # last step is one short (the first request finished a step earlier)
    assert all(r.token_ms[4] - r.token_ms[3] == pytest.approx(2.0 + 16 * 0.5) for r in crowd.requests)
    assert crowd.requests[1].token_ms[-1] - crowd.requests[1].token_ms[-2] == pytest.approx(2.0 + 15 * 0.5)
    assert all(len(r.token_ms) == 11 for r in crowd.requests)


def test_a_long_prompt_is_prefilled_in_chunks_and_a_short_one_behind_it_shares_the_last():
    c = costs(encoder_ms=0.0, prefill_ms_per_token=0.01)
    settings = SimSettings(router_ms_per_request=0.0, router_ms_per_token=0.0, max_num_batched_tokens=1000)
    result = simulate(c, Topology(cores=None), [SimRequest(0, 0.0, 2500, 1), SimRequest(1, 0.0, 400, 1)], settings)
    assert result.requests[0].ttft_ms == pytest.approx(10 + 10 + 5 + 4)  # 1000, 1000, then 500 + the short 400
    assert result.requests[1].ttft_ms == pytest.approx(29.0)


def test_the_aggregated_engine_encodes_on_its_one_thread_and_epd_overlaps_the_tiers():
    c = costs(encoder_ms=10.0, prefill_ms_per_token=10.0 / 16, decode_ms=5.0)
    load = poisson(200, 40.0, seed=1, output=8)
    aggregated = simulate(c, Topology(aggregated=True, cores=None), load, FREE)
    epd = simulate(c, Topology(cores=None), poisson(200, 40.0, seed=1, output=8), FREE)
    assert epd.percentile_ms("ttft", 90) < aggregated.percentile_ms("ttft", 90)
    assert set(aggregated.utilization) == {"aggregated"} and set(epd.utilization) == {"encoder", "prefill", "decode"}
    assert epd.goodput(slo_ttft_ms=1e9) == pytest.approx(1000 * 200 / epd.duration_ms)
    assert 0 < epd.attainment(slo_ttft_ms=epd.percentile_ms("ttft", 50)) < 1


def test_costs_interpolate_between_points_and_extend_along_the_outer_ones():
    assert interpolate([(0, 0), (10, 20)], 5) == 10
    assert interpolate([(0, 0), (10, 20)], 20) == 40  # extended
    assert interpolate([(1, 10), (2, 5)], 10) == 0  # never below zero
    c = costs(encoder_ms=10.0)
    assert c.encoder_ms(100.0, 4) == 10.0
    with pytest.raises(ValueError, match="the profile has no nccl transfers"):
        c.transfer_ms("nccl", 1.0)
    with pytest.raises(ValueError, match="not an epd profile"):
        StageCosts.from_profile({"encoder": []})


def test_a_sampled_decode_step_costs_what_the_profile_measured_sampled():
    """The profile's decode points come greedy and sampled (temperature 1: what a client that sends
    none gets); the simulator takes the sampled ones unless told the workload is greedy, and a
    profile without them (an older one) serves both."""
    profile = {"encoder": [], "transfer": [{"transport": "shm", "mb": 1.0, "ms_per_mb": 0.0}],
               "prefill": [{"prompt_tokens": 16, "prefix_cached": False, "ms_total": 0.0}],
               "decode": [{"batch": 1, "context_tokens": 100, "ms_per_step": 2.0},
                          {"batch": 1, "context_tokens": 100, "temperature": 1.0, "ms_per_step": 3.0}]}
    c = StageCosts.from_profile(profile)
    assert (c.decode_ms(1, 100), c.decode_ms(1, 100, sampled=True)) == (2.0, 3.0)
    one = lambda: [SimRequest(0, 0.0, 16, 5)]
    assert simulate(c, Topology(cores=None), one(), FREE).requests[0].tpot_ms == pytest.approx(3.0)
    greedy = dataclasses.replace(FREE, sampled=False)
    assert simulate(c, Topology(cores=None), one(), greedy).requests[0].tpot_ms == pytest.approx(2.0)
    older = StageCosts.from_profile({**profile, "decode": profile["decode"][:1]})
    assert older.decode_ms(1, 100, sampled=True) == 2.0


def test_the_serving_paths_own_costs_and_a_cold_cluster_are_added_where_they_fall():
    """``epd profile --pipeline`` figures: per request before dispatch, per image on its way to
    prefill, per decode step on the decode worker (less the router's share), and a request that
    finds the whole cluster idle pays the wake-up measured for that long an idle."""
    base = costs(encoder_ms=10.0, decode_ms=2.0)
    wake = [{"idle_s": 1.0, "text_ms": 40.0, "image_ms": 80.0}]
    path = {"epd": {"request_ms": 5.0, "image_ms": 3.0, "step_ms": 1.0, "wake": wake}}
    measured = StageCosts(**{**base.__dict__, "pipeline": path})
    first = [SimRequest(0, 0.0, 16, 3, ((1, 100.0, 4),))]
    plain = simulate(base, Topology(cores=None), first, FREE).requests[0]
    with_path = simulate(measured, Topology(cores=None), [SimRequest(0, 0.0, 16, 3, ((1, 100.0, 4),))],
                         FREE).requests[0]
    assert with_path.ttft_ms == pytest.approx(plain.ttft_ms + 5.0 + 3.0)  # a cluster just started is warm
    assert with_path.tpot_ms == pytest.approx(plain.tpot_ms + 1.0)
    # the hand-off beyond the KV's transfer: once, between the first token and the first decode step
    handed = StageCosts(**{**base.__dict__, "pipeline": {"epd": {**path["epd"], "handoff_ms": 6.0}}})
    got = simulate(handed, Topology(cores=None), [SimRequest(0, 0.0, 16, 3, ((1, 100.0, 4),))], FREE).requests[0]
    assert got.ttft_ms == pytest.approx(with_path.ttft_ms)
    assert got.token_ms[1] - got.token_ms[0] == pytest.approx(with_path.token_ms[1] - with_path.token_ms[0] + 6.0)
    assert got.token_ms[2] - got.token_ms[1] == pytest.approx(with_path.token_ms[2] - with_path.token_ms[1])
    # of the image's path, what keeps the encoder busy once a batch: the same latency alone, but an
    # image right behind waits for it too
    busy = StageCosts(**{**base.__dict__, "pipeline": {"epd": {**path["epd"], "encoder_batch_ms": 2.0}}})
    pair = lambda: [SimRequest(0, 0.0, 16, 3, ((1, 100.0, 4),)), SimRequest(1, 1.0, 16, 3, ((2, 100.0, 4),))]
    apart, behind = (simulate(c, Topology(cores=None), pair(), FREE).requests for c in (measured, busy))
    assert behind[0].ttft_ms == pytest.approx(apart[0].ttft_ms)
    assert behind[1].ttft_ms == pytest.approx(apart[1].ttft_ms + 2.0)
    late = [SimRequest(0, 0.0, 16, 1), SimRequest(1, 500.0, 16, 1), SimRequest(2, 2000.0, 16, 1, ((2, 100.0, 4),))]
    got = simulate(measured, Topology(cores=None), late, FREE).requests
    idle_s = (500.0 - got[0].token_ms[-1]) / 1000  # since the first request's last work
    assert got[1].ttft_ms == pytest.approx(got[0].ttft_ms + 40.0 * idle_s, abs=0.01)  # of 1 s measured: pro rata
    assert got[2].ttft_ms == pytest.approx(got[0].ttft_ms + 80.0 + 3.0 + 10.0, abs=0.1)  # idle past 1 s: all of it


def test_cpu_beyond_the_stages_takes_cores_from_what_runs_beside_it_and_the_client_counts_only_on_the_host():
    """The processes' CPU beyond the stages (``background``) and the client's: work on the host that
    no request waits for. One request alone is as fast as without it; a second one arriving while
    the first's 100 ms of background run shares the one core with it (its 10 ms of prefill take
    20); the client's share counts only where the client runs on the cluster's host."""
    base = costs(encoder_ms=0.0, prefill_ms_per_token=10.0 / 16)
    path = {"epd": {"background": {"request_ms": 100.0, "image_ms": 0.0, "token_ms": 0.0},
                    "client": {"request_ms": 0.0, "image_ms": 0.0, "token_ms": 50.0}}}
    measured = StageCosts(**{**base.__dict__, "pipeline": path})
    alone = simulate(measured, Topology(cores=1), [SimRequest(0, 0.0, 16, 1)], FREE).requests[0]
    assert alone.ttft_ms == pytest.approx(20.0)  # its own background beside its prefill: both on the core
    plain = simulate(base, Topology(cores=1), [SimRequest(0, 0.0, 16, 1)], FREE).requests[0]
    assert plain.ttft_ms == pytest.approx(10.0)
    two = lambda: [SimRequest(0, 0.0, 16, 1), SimRequest(1, 50.0, 16, 1)]
    second = simulate(measured, Topology(cores=1), two(), FREE).requests[1]
    # at 50 ms the first request's background has 60 ms left (half the core until 20 ms, all of it
    # since): the second's own starts beside it, so its prefill gets a third of the core: 30 ms
    assert second.ttft_ms == pytest.approx(30.0)
    with_client = simulate(measured, Topology(cores=1), two(), dataclasses.replace(FREE, client_on_host=True))
    # the first request's token (at 20 ms) costs the client 50 ms: a fourth job beside the second prefill
    assert with_client.requests[1].ttft_ms == pytest.approx(40.0)
    on_devices = simulate(measured, Topology(cores=None), two(), FREE).requests[1]
    assert on_devices.ttft_ms == pytest.approx(10.0)  # a GPU host's CPU is not what its stages share


def test_the_router_processs_cpu_beyond_its_costs_is_work_its_one_loop_does_in_turn():
    """The router's CPU beyond its measured costs (per request, image and token) is on its one
    loop: requests wait for it, each for whatever the loop took up before."""
    base = costs(encoder_ms=0.0)
    path = {"epd": {"router": {"request_ms": 7.0, "image_ms": 3.0, "token_ms": 0.0}}}
    measured = StageCosts(**{**base.__dict__, "pipeline": path})
    two = lambda: [SimRequest(0, 0.0, 16, 1), SimRequest(1, 0.0, 16, 1, ((5, 100.0, 4),))]
    plain = simulate(base, Topology(cores=None), two(), FREE).requests
    got = simulate(measured, Topology(cores=None), two(), FREE).requests
    assert [r.ttft_ms for r in plain] == [pytest.approx(0.0), pytest.approx(0.0)]
    # the loop dispatches the first (7 ms), then the second (7 + 3), and only then hands the first
    # its token: both wait for all of it
    assert [r.ttft_ms for r in got] == [pytest.approx(17.0), pytest.approx(17.0)]
    alone = simulate(measured, Topology(cores=None), two()[1:], FREE).requests[0]
    assert alone.ttft_ms == pytest.approx(10.0)


def test_epd_plan_ranks_the_splits_of_a_device_budget_and_names_bad_input(tmp_path, capsys):
    import json

    from epd.cli import main

    profile = {"model": "made-up", "device": "cuda", "host": {"threads": 1},
               "encoder": [{"image_px": 448, "batch": 1, "ms_per_item": 40.0}, {"image_px": 448, "batch": 8,
                                                                                "ms_per_item": 40.0}],
               "prefill": [{"prompt_tokens": 256, "prefix_cached": False, "ms_total": 5.0},
                           {"prompt_tokens": 2048, "prefix_cached": False, "ms_total": 40.0}],
               "decode": [{"batch": 1, "context_tokens": 512, "ms_per_step": 5.0},
                          {"batch": 64, "context_tokens": 512, "ms_per_step": 8.0}],
               "transfer": [{"transport": "shm", "mb": 1, "ms_per_mb": 0.1}]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    plot = tmp_path / "goodput.png"
    argv = ["plan", "--profile", str(path), "--devices", "4", "--slo", "ttft=500,tpot=50", "--num-prompts", "60",
            "--output-len", "16", "--plot", str(plot)]
    assert main([*argv, "--json", "--jobs", "1"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in ranked]
    assert "aggregated" in labels and "2E1P1D" in labels and all(r["devices"] <= 4 for r in ranked)
    per_device = [r["per_device"] for r in ranked]
    assert per_device == sorted(per_device, reverse=True) and per_device[0] > 0
    # the encoder is this workload's bottleneck (40 ms an image against 5 ms of prefill): the best
    # split gives it more than one device
    assert ranked[0]["topology"]["encoders"] >= 2 or ranked[0]["label"] == "aggregated"
    assert plot.stat().st_size > 0
    assert main([*argv[:-2], "--jobs", "2"]) == 0  # the same ranking searched in two processes
    table = capsys.readouterr().out
    assert "best: " in table and f"| 1 | {ranked[0]['label']} |" in table
    assert main(["plan", "--profile", str(path), "--slo", "latency=5"]) == 2
    assert "--slo: expected ttft=MS,tpot=MS, got 'latency=5'" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json")]) == 2


def test_the_serving_paths_own_costs_are_what_was_measured_less_what_the_stages_account_for():
    """``epd profile --pipeline``'s arithmetic: a text request's TTFT less its prefill and the
    router's work; an image's extra TTFT less the encoder and its rows' prefill; a stream's time per
    token less a decode step, split into per step and per token by 4 streams at once."""
    from epd.bench.pipeline_costs import Measured, derive

    c = path_costs()
    # text: 40 tokens (4 ms of prefill), image: 140 tokens (14 ms); 1 stream: 5 ms a token, 4: 11 ms
    got = derive(c, Measured(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=5.0,
                             per_token_crowded=11.0, after_idle={2.0: (45.0, 60.0), 0.1: (14.0, 51.0)}), 448)
    assert got["request_ms"] == pytest.approx(15.0 - 4.0 - 1.0)
    assert got["image_ms"] == pytest.approx(50.0 - 15.0 - 20.0 - (14.0 - 4.0))
    # alone: 5 - 3 = 2 = step + token; 4 streams: 11 - 6 = 5 = step + 4 x token -> token 1, step 1
    assert (got["step_ms"], got["token_ms"]) == (pytest.approx(1.0), pytest.approx(1.0))
    assert got["wake"] == [{"idle_s": 2.0, "text_ms": 30.0, "image_ms": 10.0},
                           {"idle_s": 0.1, "text_ms": 0.0, "image_ms": 1.0}]  # never below zero
    assert "background" not in got  # no CPU counters: nothing made up
    assert "handoff_ms" not in got  # one output length: the hand-off is not told apart


def test_the_hand_off_is_told_from_the_per_step_cost_by_two_output_lengths():
    """A request of n tokens has n - 1 gaps, the first the hand-off plus a step: with a hand-off of
    15 ms and 5 ms a step, 16 tokens come 5 + 15 / 15 = 6 ms apart on average and 2 tokens 20 ms.
    The per-step figures are those of the test above once its share is taken off; of the hand-off,
    what the simulator does not already charge as the KV's transfer (1 MB at 1 ms a MB)."""
    from epd.bench.pipeline_costs import Measured, derive

    c = path_costs(shapes={"kv_bytes_per_token": 2**20 // 40})
    measured = dict(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=7.0,
                    per_token_crowded=12.0, after_idle={}, per_token_text=6.0, per_token_short=20.0)
    got = derive(c, Measured(**measured), 448)
    assert (got["step_ms"], got["token_ms"]) == (pytest.approx(1.0), pytest.approx(1.0))  # as above
    assert got["handoff_ms"] == pytest.approx(15.0 - 1.0)
    assert got["measured"]["ms_per_token_2_tokens"] == 20.0
    assert "encoder_batch_ms" not in got  # no pair of images measured
    # one process (--aggregated): no hand-off between workers to charge, the per-step figures alike
    one = derive(c, Measured(**measured, engine_in_router=True), 448)
    assert "handoff_ms" not in one and (one["step_ms"], one["token_ms"]) == (pytest.approx(1.0), pytest.approx(1.0))


def test_the_engines_steps_timed_in_the_run_replace_the_profiles_where_they_were_read():
    """The decode engine's own time a step, read from its worker's counters while the requests ran,
    is what comes off a stream's time per token (not the profile's step, measured minutes before on
    a host whose speed drifts); the serve banner names where to read it."""
    from epd.bench.pipeline_costs import EngineMeter, Measured, decode_metrics_url, derive

    c = path_costs()
    measured = dict(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=5.0,
                    per_token_crowded=11.0, after_idle={})
    # in the run the engine took 4 ms a step alone and 7 at 4 streams: alone 5 - 4 = 1 = step +
    # token, crowded 11 - 7 = 4 = step + 4 x token -> token 1, step 0 (the profile's 3 and 6: 1 and 1)
    got = derive(c, Measured(**measured, engine_step_alone=4.0, engine_step_crowded=7.0), 448)
    assert (got["step_ms"], got["token_ms"]) == (pytest.approx(0.0), pytest.approx(1.0))
    assert got["measured"]["engine_ms_per_step"] == 4.0
    lines = ["epd serve: ready", "  encoder     127.0.0.1:1 (pid 7) metrics http://127.0.0.1:9/metrics",
             "  decode      127.0.0.1:3 (pid 9) metrics http://127.0.0.1:11/metrics",
             "  decode      127.0.0.1:4 (pid 10) metrics http://127.0.0.1:12/metrics"]
    assert decode_metrics_url(lines) == "http://127.0.0.1:11/metrics" and decode_metrics_url(lines[:2]) is None
    from epd.bench.local_server import BannerProcess, banner_processes
    banner = ["  router      http://127.0.0.1:8000 (pid 5)", *lines, "  prefill     127.0.0.1:2 (pid 8)"]
    assert banner_processes(banner) == [
        BannerProcess("router", "http://127.0.0.1:8000", 5, None),
        BannerProcess("encoder", "127.0.0.1:1", 7, "http://127.0.0.1:9/metrics"),
        BannerProcess("decode", "127.0.0.1:3", 9, "http://127.0.0.1:11/metrics"),
        BannerProcess("decode", "127.0.0.1:4", 10, "http://127.0.0.1:12/metrics"),
        BannerProcess("prefill", "127.0.0.1:2", 8, None)]
    ran = []  # a worker whose counters cannot be read: the requests still run, the profile's step stands in
    assert EngineMeter(decode_metrics_url(lines[:2])).ms_per_step(lambda: ran.append(1)) is None
    assert EngineMeter("http://127.0.0.1:9/metrics").ms_per_step(lambda: ran.append(2)) is None and ran == [1, 2]


def test_what_the_encoder_spends_after_its_forward_is_told_by_two_images_at_once():
    """The second of two image requests sent at once waits for the first's batch: its forward (20 ms
    here) and what the encoder does after it; that part of the image's path (15 ms in all: 60 - 15
    less 20 of forward less 10 of prefill) is charged to the encoder, never more than the path."""
    from epd.bench.pipeline_costs import Measured, derive

    c = path_costs(router=())
    measured = dict(ttft_text=15.0, ttft_image=60.0, tokens_text=40, tokens_image=140, per_token=5.0,
                    per_token_crowded=11.0, after_idle={})
    assert derive(c, Measured(**measured, image_pair_gap=32.0), 448)["encoder_batch_ms"] == pytest.approx(12.0)
    assert derive(c, Measured(**measured, image_pair_gap=90.0), 448)["encoder_batch_ms"] == pytest.approx(15.0)
    assert derive(c, Measured(**measured, image_pair_gap=5.0), 448)["encoder_batch_ms"] == 0.0  # batched together
    assert "encoder_batch_ms" not in derive(c, Measured(**measured, image_pair_gap=32.0, engine_in_router=True), 448)


def test_the_cpu_beyond_the_stages_is_what_the_processes_spent_less_what_is_charged():
    """The processes' CPU per request (16 and 2 output tokens, and with an image) less what the
    simulator already charges one request alone (router, encoder, prefill, decode steps, the path's
    per step and per token), split per request, per image and per token; the client's likewise."""
    from epd.bench.pipeline_costs import Measured, derive

    c = path_costs()
    # step 1 and token 1 (as above); charged: text 16 tokens = 1 + 4 + 15 x (3 + 1) + 16 x 1 = 81,
    # 2 tokens = 1 + 4 + 1 x 4 + 2 = 11, image 16 tokens = 1 + 14 + 20 + 60 + 16 = 111; of which
    # the router's (1 before dispatch, 1 a token): 17, 3, 17. Beyond them the router spends 5 a
    # request, 4 an image and 0.5 a token, the other processes 30, 25 and 2, the client 8, 15, 2.
    router = {"text": 17.0 + 5.0 + 16 * 0.5, "short": 3.0 + 5.0 + 2 * 0.5, "image": 17.0 + 5.0 + 4.0 + 16 * 0.5}
    others = {"text": 30.0 + 16 * 2.0, "short": 30.0 + 2 * 2.0, "image": 30.0 + 25.0 + 16 * 2.0}
    charged = {"text": 81.0, "short": 11.0, "image": 111.0}
    client = {"text": 40.0, "short": 12.0, "image": 55.0}
    cpu = {kind: (charged[kind] + router[kind] - {"text": 17.0, "short": 3.0, "image": 17.0}[kind] + others[kind],
                  client[kind], router[kind]) for kind in charged}
    got = derive(c, Measured(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=5.0,
                             per_token_crowded=11.0, after_idle={}, cpu=cpu), 448)
    assert got["router"] == split_of(5.0, 4.0, 0.5)
    assert got["background"] == split_of(30.0, 25.0, 2.0)
    assert got["client"] == split_of(8.0, 15.0, 2.0)
    # --aggregated: the router's process runs every stage, so what is beyond them is that one
    # process's, beside its steps (torch's kernels run without the interpreter lock), not its loop's
    one = {kind: (charged[kind] + others[kind], client[kind], charged[kind] + others[kind]) for kind in charged}
    got = derive(c, Measured(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=5.0,
                             per_token_crowded=11.0, after_idle={}, cpu=one, engine_in_router=True), 448)
    assert got["router"] == {"request_ms": 0.0, "image_ms": 0.0, "token_ms": 0.0}
    assert got["background"] == split_of(30.0, 25.0, 2.0)


def test_a_loaded_clusters_cpu_a_request_an_image_and_a_token_comes_from_paced_streams_and_crowds():
    """One request alone wakes idle processes for every token and pays a step's message and
    wake-ups for one stream; under load they stay awake, and requests that overlap share both. What
    a loaded cluster spends per request, image and token is measured at two loads: paced streams
    (about one request in flight: each one's decode batch as it ran) and four requests at once,
    each text with 16 and with 2 tokens, and with an image; the paced figures are the part's own."""
    from epd.bench.pipeline_costs import Measured, derive

    c = path_costs(shapes={"row_bytes": 2 ** 20 // 100})
    # the path's step 1 and token 1 (the test above). Charged: alone text 81, short 11, image 111
    # (the router's 17, 3, 17); paced, decode batches 2, 1, 2 (a step 4 ms at batch 2, images one at
    # a time): text 17 + 4 + 15 x (4 + 1) / 2 = 58.5, short 11, with an image 17 + 14 + 20 + 37.5 =
    # 88.5; four at once, text 17 + 4 + 15 x (6 + 1) / 4 = 47.25, short 3 + 4 + 1 x 7 / 4 = 8.75, with
    # an image 17 + 14 + 20 + 26.25 = 77.25. Beyond them, per part: a request, an image and a token
    # alone, paced and at once
    parts = {"router": ((5.0, 4.0, 0.5), (4.0, 3.0, 0.4), (3.0, 2.0, 0.3)),
             "others": ((30.0, 25.0, 2.0), (24.0, 16.0, 1.2), (20.0, 10.0, 0.8)),
             "client": ((8.0, 15.0, 2.0), (7.0, 9.0, 1.5), (6.0, 5.0, 1.0))}
    kinds = {"text": (16, False, 0), "short": (2, False, 0), "image": (16, True, 0),
             "paced": (16, False, 1), "paced_short": (2, False, 1), "paced_image": (16, True, 1),
             "crowded": (16, False, 2), "crowded_short": (2, False, 2), "crowded_image": (16, True, 2)}

    def beyond(part: str, kind: str) -> float:
        tokens, with_image, load = kinds[kind]
        request, image, token = parts[part][load]
        return request + image * with_image + tokens * token

    charged = {"text": 81.0, "short": 11.0, "image": 111.0, "paced": 58.5, "paced_short": 11.0,
               "paced_image": 88.5, "crowded": 47.25, "crowded_short": 8.75, "crowded_image": 77.25}
    on_router = {kind: 3.0 if kind.endswith("short") else 17.0 for kind in charged}
    cpu = {kind: (charged[kind] + beyond("router", kind) + beyond("others", kind), beyond("client", kind),
                  on_router[kind] + beyond("router", kind)) for kind in charged}
    got = derive(c, Measured(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=5.0,
                             per_token_crowded=11.0, after_idle={}, cpu=cpu,
                             paced_batch={"paced": 2.0, "paced_short": 1.0, "paced_image": 2.0}), 448)
    for part, name in (("router", "router"), ("others", "background"), ("client", "client")):
        (_, paced, at_once) = parts[part]
        assert {k: v for k, v in got[name].items() if k != "points"} == split_of(*paced)
        assert got[name]["points"] == [{"in_flight": 1.67, **split_of(*paced)}, {"in_flight": 4, **split_of(*at_once)}]
    # the router's loop does its part before dispatch, and the image's 100 rows (1 MB) go over shared
    # memory: the path's delays are what is left of the TTFTs (text 15 - prefill 4 - router 1 - 4,
    # image 50 - 15 - encoder 20 - prefill 10 - router 3 - the rows' 1 ms)
    assert got["request_ms"] == pytest.approx(10.0 - 4.0)
    assert got["image_ms"] == pytest.approx(5.0 - 3.0 - 1.0, abs=1e-3)
    # the simulator reads a part's figures at the load it runs: along the line between the two,
    # no further than the loads measured
    loaded = StageCosts(**{**c.__dict__, "pipeline": {"epd": got}})
    assert [loaded.cpu_beyond_ms(False, "background", "request_ms", n) for n in (0, 1.67, 2.835, 4, 64)] == [
        pytest.approx(24.0), pytest.approx(24.0), pytest.approx(22.0), pytest.approx(20.0), pytest.approx(20.0)]


def test_a_decode_workers_step_is_the_profiles_scaled_by_how_its_engine_stepped_in_the_run():
    """A decode worker's engine also imports KV and hands each step's tokens on: where ``epd
    profile --pipeline`` read its engine's steps (batch 1: 6 ms, batch 4: 12 ms) against the
    profile's in-process ones (3, 6), the simulator's steps are scaled by that (x2 at 1 and 4, in
    between along the line, never below the profile's); without those figures, the profile's."""
    base = costs(decode_ms=2.0, decode_ms_per_seq=1.0)  # 3 ms at batch 1, 6 at 4
    assert base.served_step_ms(4, 100) == pytest.approx(6.0)
    measured = {"epd": {"measured": {"engine_ms_per_step": 6.0, "engine_ms_per_step_4_streams": 12.0}}}
    scaled = StageCosts(**{**base.__dict__, "pipeline": measured})
    assert [scaled.served_step_ms(b, 100) for b in (1, 4, 64)] == [pytest.approx(6.0), pytest.approx(12.0),
                                                                    pytest.approx(2 * 66.0)]
    faster = StageCosts(**{**base.__dict__, "pipeline": {"epd": {"measured": {
        "engine_ms_per_step": 1.5, "engine_ms_per_step_4_streams": 3.0}}}})
    assert faster.served_step_ms(1, 100) == pytest.approx(3.0)
    one = simulate(scaled, Topology(cores=None), [SimRequest(0, 0.0, 16, 3)], FREE).requests[0]
    assert one.tpot_ms == pytest.approx(6.0)


def test_what_a_decode_workers_engine_spent_beyond_the_profiles_step_is_charged_once():
    """The simulator charges a decode worker's steps as its engine stepped in the run (twice the
    profile's here: 6 and 12 ms at batch 1 and 4 against 3 and 6), so the CPU beyond the stages
    leaves those steps out: only what the processes spent besides them remains."""
    from epd.bench.pipeline_costs import Measured, derive

    c = path_costs()
    # one stream 8 ms a token, four 14: the path's step 8 - 6 = 2, its token 0. Charged: text 1 + 4
    # + 15 x (6 + 2) = 125, short 1 + 4 + 8 = 13, image 1 + 14 + 20 + 120 = 155 (the router's 1 each);
    # beyond them the other processes 30 a request, 25 an image, 2 a token
    charged = {"text": 125.0, "short": 13.0, "image": 155.0}
    others = {"text": 30.0 + 16 * 2.0, "short": 30.0 + 2 * 2.0, "image": 30.0 + 25.0 + 16 * 2.0}
    cpu = {kind: (charged[kind] + others[kind], 0.0, 1.0) for kind in charged}
    got = derive(c, Measured(ttft_text=15.0, ttft_image=50.0, tokens_text=40, tokens_image=140, per_token=8.0,
                             per_token_crowded=14.0, after_idle={}, cpu=cpu, engine_step_alone=6.0,
                             engine_step_crowded=12.0), 448)
    assert (got["step_ms"], got["token_ms"]) == (pytest.approx(2.0), pytest.approx(0.0))
    assert got["background"] == split_of(30.0, 25.0, 2.0)


def test_the_host_cpu_beside_the_requests_is_charged_at_the_count_in_flight(monkeypatch):
    """The CPU beyond the stages was measured at two loads (paced: 8 ms a request; four at once: 2),
    so a request that arrives while others run is charged along the line between them: four
    arriving together are charged 8, 6, 4 and 2 ms; the same four a second apart 8 each."""
    from epd.plan import engine

    charged = []
    start = engine.Device.start

    def counting(self, work_ms, demand, owner, on_done):
        if owner == "background":
            charged.append(work_ms)
        return start(self, work_ms, demand, owner, on_done)
    monkeypatch.setattr(engine.Device, "start", counting)
    points = [{"in_flight": 1.0, "request_ms": 8.0, "image_ms": 0.0, "token_ms": 0.0},
              {"in_flight": 4, "request_ms": 2.0, "image_ms": 0.0, "token_ms": 0.0}]
    loaded = StageCosts(**{**costs(encoder_ms=0.0, prefill_ms_per_token=0.5).__dict__,
                           "pipeline": {"epd": {"background": {**points[0], "points": points}}}})
    together = [SimRequest(i, 0.0, 16, 1) for i in range(4)]
    simulate(loaded, Topology(cores=None), together, FREE)
    assert charged == [pytest.approx(ms) for ms in (8.0, 6.0, 4.0, 2.0)]
    charged.clear()
    apart = [SimRequest(i, 1000.0 * i, 16, 1) for i in range(4)]
    simulate(loaded, Topology(cores=None), apart, FREE)
    assert charged == [pytest.approx(8.0)] * 4
