"""A worker told to stop (SIGTERM: Kubernetes, a rollout, epd serve) drains: its health says
DRAINING, the router sends it nothing new, the stream it holds finishes on it (no migration), then
it exits; a new request meanwhile goes to the other worker."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from epd.models.presets import write_preset_checkpoint
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import SamplingParams
from tests.e2e.serve_process import wait_until

pytestmark = pytest.mark.slow
LONG = SamplingParams(max_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("drain") / "ckpt", seed=77)


def test_a_stopping_decode_worker_finishes_its_stream_and_takes_no_new_one(model_dir):
    messages = [{"role": "user", "content": "Tell a long story."}]
    with LocalCluster(str(model_dir), num_decodes=2) as cluster, \
            SyncRouter.over_workers(model_dir, encoders=cluster.encoders, prefills=cluster.prefills,
                                    decodes=cluster.decodes, health_period_s=0.2) as router:
        reference = router.chat(messages, LONG).token_ids
        workers = router.pipeline.backend.workers
        tokens, errors = [], []
        resume = threading.Event()

        def stream() -> None:
            try:
                for event in router.stream(messages, LONG):
                    tokens.extend(event.token_ids)
                    if len(tokens) > 2:
                        # the reader pulls no more until the worker was told to stop: the stream stays open
                        # on it (a slow reader alone raced the decode, whose tokens reach a lagging reader
                        # in one piece: by the next look the whole stream could be over)
                        resume.wait(60)
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

        reader = threading.Thread(target=stream)
        reader.start()
        try:
            assert wait_until(lambda: len(tokens) > 2, 60)
            busy = next(w for w in workers.workers["decode"] if w.in_flight)
            other = next(w for w in workers.workers["decode"] if w is not busy)
            process = next(p for p in cluster.processes if p.tier == "decode" and p.address == busy.address)
            process.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: busy.stopping, 10)  # its health said DRAINING
            assert workers.candidates("decode") == [c for c in workers.candidates("decode")
                                                    if c.address == other.address]
            assert router.chat(messages, LONG).token_ids == reference  # the new request went to the other one
        finally:
            resume.set()
        reader.join(120)
        assert not errors and tokens == reference  # the stream it held finished on it
        assert sum(router.pipeline.backend.moves.values()) == 0  # nothing migrated
        process.proc.wait(30)  # and then it stopped, cleanly
        assert process.proc.returncode == 0


def test_a_stopping_router_finishes_its_streams_and_refuses_new_connections(model_dir):
    import httpx
    import openai

    with LocalCluster(str(model_dir)) as cluster:
        router = cluster.start_router()
        base = router.ready_fields[0]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Tell a long story."}]
        stream = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=64, stream=True,
                                                stream_options={"include_usage": True})
        chunks = [next(stream)]
        router.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        for chunk in stream:  # the stream in flight finishes whole
            chunks.append(chunk)
            time.sleep(0.02)
        assert chunks[-1].usage.completion_tokens == 64
        with pytest.raises(httpx.ConnectError):  # a new connection is refused meanwhile or after
            httpx.get(f"{base}/health", timeout=5)
        router.proc.wait(30)
        assert router.proc.returncode == 0
