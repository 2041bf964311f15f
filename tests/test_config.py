"""The config tree: typed, validated once, every mistake one line naming key, expectation and value;
flags come from the same definitions for every command (``epd/server/flags.py``)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epd.config import ConfigError, EncoderConfig, EngineConfig, RouterConfig, WorkerConfig, load_config
from epd.server.router import router_config_from_args
from epd.server.serve import serve_command, serve_config_from_args
from epd.server.tier import tier_command, worker_config_from_args


def test_yaml_config_with_overrides(tmp_path):
    path = tmp_path / "prefill.yaml"
    path.write_text("model: small-qwen2-vl\nport: 7001\nengine:\n  block_size: 32\n  max_num_batched_tokens: 512\n")
    cfg = worker_config_from_args("prefill", ["--config", str(path), "--port", "0", "--no-overlap",
                                              "--max-num-batched-tokens", "256"])
    assert cfg.model == "small-qwen2-vl" and cfg.port == 0
    assert cfg.engine == EngineConfig(block_size=32, max_num_batched_tokens=256)  # the flag wins over the file
    assert cfg.overlap_prefill_with_encode is False


def test_the_encoder_section_is_typed(tmp_path):
    path = tmp_path / "encoder.yaml"
    path.write_text("encoder:\n  encoder_batch_size: 4\n  cuda_graph_buckets: [[1024, 4]]\n  device: cuda\n")
    cfg = worker_config_from_args("encoder", ["--config", str(path), "--encoder-max-num-tokens", "2048"])
    assert cfg.encoder == EncoderConfig(encoder_batch_size=4, encoder_max_num_tokens=2048,
                                        cuda_graph_buckets=((1024, 4),), device="cuda")


@pytest.mark.parametrize("yaml_text, message", [
    ("modle: x\n", "unknown key 'modle'"),
    ("engine:\n  block_size: many\n", "engine.block_size: Input should be a valid integer"),
    ("lease_ttl_s: 0\n", "lease_ttl_s: Input should be greater than 0, got 0"),
    ("engine:\n  max_num_seqs: true\n", "engine.max_num_seqs: expected an integer, got True"),
    ("engine:\n  dtype: float64\n", "engine.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16', got 'float64'"),
    ("port: 70000\n", "port: Input should be less than or equal to 65535, got 70000"),
])
def test_a_wrong_key_or_value_is_one_line_naming_it(tmp_path, yaml_text, message):
    path = tmp_path / "decode.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        worker_config_from_args("decode", ["--config", str(path)])
    assert message in str(info.value) and str(info.value).startswith(str(path)) and "\n" not in str(info.value)


def test_a_wrong_flag_value_is_one_line_on_stderr_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "epd", "router", "--max-concurrent-requests", "lots"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("epd router: error: command line: max_concurrent_requests: Input should be a valid "
                                   "integer, unable to parse string as an integer, got 'lots'")


def test_one_flag_sets_every_field_of_its_name():
    config = serve_config_from_args(["--model", "m", "--max-model-len", "1024", "--dtype", "bfloat16",
                                     "--transport", "inline", "--allow-private-network", "--no-overlap"])
    assert config.router.model == config.worker.model == "m"
    assert config.router.max_model_len == config.worker.engine.max_model_len == 1024
    assert config.worker.engine.dtype == config.worker.encoder.dtype == "bfloat16"
    assert config.router.transport == config.worker.transport == "inline"
    assert config.router.allow_private_network and not config.worker.overlap_prefill_with_encode


def test_commands_take_their_flags_from_the_same_definitions():
    def flags(command):
        return set(command.flags)
    router = {path[1] for flag in serve_command().flags.values() for path in flag.paths if path[0] == "router"}
    # epd serve has every router flag the router process has, but the worker lists it assigns itself
    # (and the engine section, which it fills from the workers' own engine flags with --aggregated,
    # and what it sets on each of its --routers: their shared socket, index and gRPC)
    assert router == set(RouterConfig.model_fields) - {"encoders", "prefills", "decodes", "engine", "http_fd",
                                                       "router_index", "public_grpc"}
    assert {"allow_private_network", "allowed_local_media_path"} <= router
    assert "max_num_batched_tokens" in flags(tier_command("prefill"))
    assert "max_num_batched_tokens" not in flags(tier_command("encoder"))  # an encoder has no LLM engine
    assert "encoder_batch_size" not in flags(tier_command("decode"))
    assert router_config_from_args(["--encoders", "a:1,b:2"]).encoders == ("a:1", "b:2")


def test_configs_validate_on_construction_too():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float64")
    with pytest.raises(ConfigError, match="RouterConfig: queue_timeout_s: Input should be greater than 0"):
        load_config(RouterConfig, {"queue_timeout_s": 0}, source="RouterConfig")
    assert WorkerConfig().engine == EngineConfig() and hash(WorkerConfig())


def test_engine_settings_reach_the_in_process_engine_and_nothing_else():
    config = serve_config_from_args(["--aggregated", "--max-num-batched-tokens", "128"])
    assert config.router.engine.max_num_batched_tokens == 128 == config.worker.engine.max_num_batched_tokens
    assert serve_config_from_args(["--max-num-batched-tokens", "128"]).router.engine == EngineConfig()
    with pytest.raises(ConfigError, match=r"engine settings \['max_num_batched_tokens'\] apply only with aggregated"):
        router_config_from_args(["--max-num-batched-tokens", "128"])
    assert router_config_from_args(["--aggregated", "--max-num-batched-tokens", "128"]).engine.max_num_batched_tokens \
        == 128
    with pytest.raises(ConfigError, match="use the local launcher"):
        serve_config_from_args(["--aggregated", "--launcher", "ray"])


def test_ray_takes_what_the_command_line_set_on_top_of_its_yaml(tmp_path):
    from epd.server.ray import deployment_from
    path = tmp_path / "cluster.yaml"
    path.write_text("http_port: 9000\ntiers:\n  encoder: {replicas: 2, config: {encoder: {encoder_batch_size: 4}}}\n"
                    "router: {max_concurrent_requests: 8}\n")
    given = deployment_from(serve_config_from_args(["--ray-config", str(path), "--prefills", "3",
                                                    "--max-queued-requests", "5", "--lease-ttl-s", "30"]))
    assert given.http_port == 9000 and given.tiers["encoder"].replicas == 2 and given.tiers["prefill"].replicas == 3
    assert given.router.max_concurrent_requests == 8 and given.router.max_queued_requests == 5
    assert given.tiers["encoder"].config.encoder.encoder_batch_size == 4
    assert all(spec.config.lease_ttl_s == 30 for spec in given.tiers.values())
    assert deployment_from(serve_config_from_args(["--ray-config", str(path), "--port", "7000"])).http_port == 7000


@pytest.mark.parametrize("name", ["cluster.yaml", "multinode.yaml"])
def test_the_shipped_ray_deployments_load(name):
    from epd.config import RayDeployment, load_config, load_yaml
    from epd.server.ray_sizing import actor_demands

    path = Path(__file__).resolve().parents[1] / "deploy" / "ray" / name
    deployment = load_config(RayDeployment, load_yaml(path), source=str(path))
    assert deployment.host == "node"
    if name == "multinode.yaml":  # the router asks for the node users reach
        assert dict(actor_demands(deployment))["router"]["ingress"] == 1


def test_auto_device_and_dtype_resolve_where_the_model_runs(monkeypatch):
    import torch

    for cls in (EngineConfig, EncoderConfig):
        assert (cls().device, cls().dtype) == ("auto", "auto")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert (cls().target_device, cls().torch_dtype) == ("cpu", torch.float32)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert (cls().target_device, cls().torch_dtype) == ("cuda", torch.bfloat16)
        assert cls(device="cpu").torch_dtype == torch.float32  # auto dtype follows the device given
        assert cls(device="auto", dtype="float16").torch_dtype == torch.float16


def test_per_tier_gpus_become_each_workers_device():
    config = serve_config_from_args(["--encoder-gpus", "0", "--prefill-gpus", "1,2", "--decodes", "3"])
    assert config.devices("encoder") == ["cuda:0"] and config.devices("prefill") == ["cuda:1", "cuda:2"]
    assert config.devices("decode") == []
    with pytest.raises(ConfigError, match=r"decode_gpus: expected CUDA device indices like 0 or 0,1, got 'x'"):
        serve_config_from_args(["--decode-gpus", "x"])


def test_a_tensor_parallel_worker_takes_the_next_tp_gpus_of_its_tier(monkeypatch):
    """``--prefill-gpus 0,1 --prefill-tp 2`` is one worker on GPUs 0 and 1; more workers take the
    next ranks' GPUs round robin; fewer GPUs than ranks is refused (NCCL needs one per rank), and so
    is a GPU this host does not have, in one line at start."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    config = serve_config_from_args(["--prefill-gpus", "0,1", "--prefill-tp", "2", "--decode-gpus", "0,1,2",
                                     "--decode-tp", "2", "--decodes", "3", "--device", "cpu"])
    assert config.devices("prefill") == ["cuda:0,1"]
    assert config.devices("decode") == ["cuda:0,1", "cuda:2,0", "cuda:1,2"]
    config = serve_config_from_args(["--prefill-gpus", "0,1,2,3", "--prefill-tp", "2", "--prefills", "2",
                                     "--device", "cpu"])
    assert config.devices("prefill") == ["cuda:0,1", "cuda:2,3"]
    with pytest.raises(ValueError, match="--prefill-gpus 0 has 1 GPU.* give at least 2"):
        serve_config_from_args(["--prefill-gpus", "0", "--prefill-tp", "2", "--device", "cpu"]).devices("prefill")
    with pytest.raises(ConfigError, match=r"--prefill-gpus: tensor_parallel_devices 1,1: two ranks on one device"):
        serve_config_from_args(["--prefill-gpus", "1,1", "--prefill-tp", "2", "--device", "cpu"])
    with pytest.raises(ConfigError, match=r"on cuda:3, cuda:4: this process sees 4 CUDA device\(s\).*cuda:4 is not"):
        serve_config_from_args(["--prefill-gpus", "3,4", "--prefill-tp", "2", "--device", "cpu"])


def test_each_tensor_parallel_rank_has_one_device():
    assert [EngineConfig(tensor_parallel_size=2, device="cuda:2").rank_device(r) for r in (0, 1)] == \
        ["cuda:2", "cuda:3"]  # consecutive from --device's, as vLLM
    given = EngineConfig(tensor_parallel_size=2, tensor_parallel_devices="3,1")
    assert given.device == "cuda:3" and [given.rank_device(r) for r in (0, 1)] == ["cuda:3", "cuda:1"]
    assert EngineConfig(tensor_parallel_size=2, device="cpu").rank_device(1) == "cpu"
    for kwargs, message in ((dict(tensor_parallel_devices="1"), "names 1 device.* give one per rank"),
                            (dict(tensor_parallel_devices="1,1"), "two ranks on one device"),
                            (dict(tensor_parallel_devices="0,1", device="cpu"), "are CUDA devices, but device is cpu"),
                            (dict(tensor_parallel_devices="0,1", device="cuda:1"), "rank 0 runs on the first"),
                            (dict(cuda_graph_batch_sizes=(1, 8)), "1,8 with tensor_parallel_size 2: .* run eager")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(tensor_parallel_size=2, **kwargs)
