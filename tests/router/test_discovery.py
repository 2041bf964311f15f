"""Workers discovered from a name (a Kubernetes headless Service's DNS), with the answers scripted
here: real tier processes join when their address appears and are drained when it goes, without
dropping a request in flight; a lookup that fails changes nothing; a non-EPD address never joins."""
from __future__ import annotations

import threading
import time

import pytest

from epd.config import RouterConfig
from epd.models.presets import write_preset_checkpoint
from epd.router.backends.disaggregated import DisaggregatedBackend
from epd.router.pipeline import RequestPipeline
from epd.router.sync import SyncRouter
from epd.server.local import LocalCluster
from epd.types import SamplingParams
from tests.e2e.serve_process import wait_until

pytestmark = pytest.mark.slow


class ScriptedDns:
    """What the decode Service resolves to now; set by the test; ``fail`` makes lookups raise."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses, self.fail, self.lookups = list(addresses), False, 0

    async def __call__(self, target: str) -> list[str]:
        self.lookups += 1
        if self.fail:
            raise OSError("temporary failure in name resolution")
        return list(self.addresses)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("disc") / "ckpt", seed=99)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with LocalCluster(str(model_dir), num_decodes=2) as cluster:
        yield cluster


def decode_addresses(router: SyncRouter) -> set[str]:
    return {w.address for w in router.pipeline.backend.workers.workers["decode"]}


def test_workers_join_and_leave_with_the_name_without_dropping_a_stream(cluster, model_dir):
    first, second = cluster.decodes
    dns = ScriptedDns([first])
    config = RouterConfig(model=str(model_dir), encoders=cluster.encoders, prefills=cluster.prefills,
                          decode_service="epd-decode-headless.epd.svc.cluster.local:50051",
                          discovery_period_s=0.2, discovery_drain_timeout_s=60)
    with SyncRouter(RequestPipeline(model_dir, config, DisaggregatedBackend(config, model_dir, resolve=dns))) as router:
        assert decode_addresses(router) == {first}
        messages = [{"role": "user", "content": "Tell a long story."}]
        reference = router.chat(messages, SamplingParams(max_tokens=48)).token_ids

        # a stream on the first decode worker while the name stops answering it
        tokens, errors = [], []

        def stream() -> None:
            try:
                for event in router.stream(messages, SamplingParams(max_tokens=48)):
                    tokens.extend(event.token_ids)
                    time.sleep(0.02)  # a slow reader: the stream is still running when the name changes
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

        reader = threading.Thread(target=stream)
        reader.start()
        assert wait_until(lambda: len(tokens) > 0, 60)
        dns.addresses = [second]  # scaled: the first pod is leaving, a new one came
        assert wait_until(lambda: second in decode_addresses(router), 30)
        reader.join(120)
        assert not errors and tokens == reference  # the draining worker finished what it held
        assert wait_until(lambda: decode_addresses(router) == {second}, 30)  # then it was forgotten
        assert router.chat(messages, SamplingParams(max_tokens=48)).token_ids == reference  # on the new one

        dns.fail = True  # a DNS hiccup drains nothing
        lookups = dns.lookups
        assert wait_until(lambda: dns.lookups > lookups + 2, 10)
        assert decode_addresses(router) == {second}
        dns.fail = False

        dns.addresses = [second, cluster.encoders[0]]  # an address that is no decode worker never joins
        lookups = dns.lookups
        assert wait_until(lambda: dns.lookups > lookups + 2, 10)
        assert decode_addresses(router) == {second}


def test_a_service_name_must_be_host_and_port():
    from epd.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="decode_service: .*expected host:port"):
        load_config(RouterConfig, {"decode_service": "epd-decode-headless"})
