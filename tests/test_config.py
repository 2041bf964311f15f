import pytest

from epd.config import EngineConfig, WorkerConfig
from epd.tier_cli import worker_config_from_args


def test_yaml_config_with_overrides(tmp_path):
    path = tmp_path / "prefill.yaml"
    path.write_text("model: small-qwen2-vl\nport: 7001\nengine:\n  block_size: 32\n  max_num_batched_tokens: 512\n"
                    "encoder:\n  encoder_batch_size: 4\n")
    cfg = worker_config_from_args("prefill", ["--config", str(path), "--port", "0", "--no-overlap"])
    assert cfg.model == "small-qwen2-vl" and cfg.port == 0
    assert cfg.engine == EngineConfig(block_size=32, max_num_batched_tokens=512)
    assert cfg.encoder == {"encoder_batch_size": 4} and cfg.overlap_prefill_with_encode is False


def test_unknown_keys_are_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("modle: x\n")
    with pytest.raises(ValueError, match=r"unknown keys \['modle'\]"):
        worker_config_from_args("decode", ["--config", str(path)])


@pytest.mark.parametrize("kwargs,field", [(dict(port=70000), "port"), (dict(lease_ttl_s=0), "lease_ttl_s")])
def test_invalid_worker_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**kwargs)


def test_engine_config_validates():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float64")
