"""A Ray deployment is checked against the cluster before any actor is placed (a deployment that
cannot fit used to leave actors pending forever, silently); on a one-node Ray the launcher
started itself, tiers without their own num_cpus share the node."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from epd.config import RayDeployment, TierSpec
from epd.server.ray_sizing import ROUTER_CPUS, SizingError, check_fits, fit_local


def deployment(**tiers) -> RayDeployment:
    return RayDeployment(tiers=tiers)


def test_on_a_two_cpu_node_the_tiers_share_what_the_router_leaves():
    fitted = fit_local(deployment(), node_cpus=2)
    assert [fitted.tiers[t].num_cpus for t in ("encoder", "prefill", "decode")] == [0.5, 0.5, 0.5]
    check_fits(fitted, [{"CPU": 2.0}])
    with pytest.raises(SizingError):
        check_fits(deployment(), [{"CPU": 2.0}])  # unfitted: 3.5 CPUs on 2
    roomy = fit_local(deployment(), node_cpus=16)
    assert all(spec.num_cpus == 1.0 for spec in roomy.tiers.values())  # never more than one each


def test_an_explicit_num_cpus_is_kept_and_a_deployment_too_large_is_named():
    d = fit_local(deployment(encoder=TierSpec(num_cpus=4), prefill=TierSpec(num_cpus=4), decode=TierSpec(num_cpus=4)),
                  node_cpus=2)
    assert d.tiers["encoder"].num_cpus == 4
    with pytest.raises(SizingError) as err:
        check_fits(d, [{"CPU": 2.0}])
    message = str(err.value)
    assert f"asks for {12 + ROUTER_CPUS:g} CPU" in message and "the Ray cluster has 2 CPU on 1 node(s)" in message
    assert "1 encoder x 4 CPU" in message and "router 0.5 CPU" in message


def test_a_tensor_parallel_worker_is_one_actor_asking_for_every_ranks_share_on_one_node():
    """num_cpus / num_gpus are per rank: a TP2 decode on 1 GPU per rank asks 2 GPUs of one node
    (its ranks are its processes); two nodes of one GPU each cannot hold it, one of two can."""
    from epd.config import EngineConfig, WorkerConfig

    tp2 = TierSpec(num_gpus=1, config=WorkerConfig(engine=EngineConfig(tensor_parallel_size=2)))
    assert tp2.actor_resources() == {"CPU": 2.0, "GPU": 2.0}
    d = deployment(encoder=TierSpec(num_gpus=1), prefill=TierSpec(num_gpus=1), decode=tp2)
    with pytest.raises(SizingError, match=r"actor 'decode 0' asks for 2 CPU, 2 GPU and no single node has that"):
        check_fits(d, [{"CPU": 8.0, "GPU": 1.0}] * 4)
    check_fits(d, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}])
    # on a one-node Ray the shares are per rank: 1.5 CPUs left for 4 ranks
    shared = fit_local(deployment(decode=TierSpec(config=WorkerConfig(engine=EngineConfig(tensor_parallel_size=2)))),
                       node_cpus=2)
    assert [shared.tiers[t].num_cpus for t in ("encoder", "prefill", "decode")] == [0.37, 0.37, 0.37]
    check_fits(shared, [{"CPU": 2.0}])


def test_epd_serve_gives_each_ray_tier_its_own_tensor_parallel_size():
    from epd.server.ray import deployment_from
    from epd.server.serve import serve_config_from_args

    d = deployment_from(serve_config_from_args(["tiny-qwen2-vl", "--launcher", "ray", "-tp", "2", "--decode-tp", "4"]))
    assert [d.tiers[t].ranks for t in ("encoder", "prefill", "decode")] == [1, 2, 4]
    assert deployment_from(serve_config_from_args(["tiny-qwen2-vl", "--launcher", "ray"])).tiers["decode"].ranks == 1


def test_an_actor_larger_than_every_node_is_named_even_when_the_total_fits():
    d = deployment(encoder=TierSpec(num_gpus=2), prefill=TierSpec(), decode=TierSpec())
    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    with pytest.raises(SizingError, match=r"actor 'encoder 0' asks for 1 CPU, 2 GPU and no single node has that"):
        check_fits(d, nodes)
    check_fits(deployment(encoder=TierSpec(num_gpus=1)), nodes)


@pytest.mark.slow
def test_epd_serve_on_ray_refuses_an_oversized_deployment_in_seconds(tmp_path, short_tmp):
    """The command a user runs: a sizing error is one line within seconds, not a hang."""
    config = tmp_path / "ray.yaml"
    config.write_text("tiers:\n  encoder: {num_cpus: 64}\n")
    env = {**os.environ, "RAY_TMPDIR": str(short_tmp("ray"))}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "epd", "serve", "--launcher", "ray", "--ray-config", str(config),
                           "--port", "0", "--grpc-port", "0"], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-2000:]
    assert "epd serve: error: the deployment asks for" in done.stderr and "64 CPU" in done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 60, elapsed  # Ray's own start included; no actor was ever placed


@pytest.mark.slow
def test_epd_serve_on_ray_serves_on_this_small_machine_and_killed_hard_leaves_nothing(short_tmp):
    """Three tiers at one CPU each and the router used to ask 3.5 CPUs of a 2-CPU machine and hang;
    on the one-node Ray it starts itself, the launcher shares the node instead. Then the driver is
    killed with SIGKILL: Ray ends the actors (their owner is gone) and its head processes, and the
    reaper started with the one-node Ray ends Ray's agents, which would outlive the driver; nothing
    of EPD's is left in /dev/shm. (A graceful stop on Ray: tests/deploy/test_ray.py.)"""
    import openai

    from epd.bench.chaos import segments_of
    from tests.e2e.serve_process import ServeProcess, wait_until
    from tests.procs import descendants, gone

    serve = ServeProcess("--launcher", "ray", timeout_s=240, env={"RAY_TMPDIR": str(short_tmp("ray"))})
    tree = descendants(serve.proc.pid)
    try:
        client = openai.OpenAI(base_url=f"{serve.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="tiny-qwen2-vl", max_tokens=4, messages=[{"role": "user",
                                                                                           "content": "Hi"}])
        assert out.usage.completion_tokens == 4
        tree |= descendants(serve.proc.pid)
        os.kill(serve.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: all(gone(pid) for pid in tree), 10, period_s=0.1), \
            [open(f"/proc/{pid}/cmdline").read()[:80] for pid in tree if not gone(pid)]
        assert not [name for pid in tree for name in segments_of(pid)]
    finally:
        for pid in tree:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
