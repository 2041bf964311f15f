"""vLLM's ``vllm serve`` flags on ``epd serve`` (and the router and worker commands): each one is
ours, accepted with one line saying why it is so here already, or refused in one line naming it
and the nearest flag we have; never argparse's usage dump, never silently dropped. Checked against
vLLM's own flag list (tests/data/vllm_serve_flags.txt, from its documented ``vllm serve`` usage)."""
from __future__ import annotations

from pathlib import Path

import pytest

from epd.config import ConfigError
from epd.server.serve import serve_command, serve_config_from_args
from epd.server.vllm_flags import VLLM_FLAGS, Accepted, Refused, translate

VLLM_LIST = Path(__file__).parent / "data" / "vllm_serve_flags.txt"


def _vllm_flags() -> list[tuple[str, str]]:
    """(flag, arity: value | bool) of every ``vllm serve`` flag in the list."""
    rows = []
    for line in VLLM_LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            flag, arity = line.split()[:2]
            rows.append((flag, arity))
    return rows


def test_every_vllm_serve_flag_is_ours_accepted_or_refused_in_one_line(capsys):
    ours = serve_command().parser._option_string_actions
    outcomes = {"ours": 0, "accepted": 0, "refused": 0}
    for flag, arity in _vllm_flags():
        argv = [flag] if arity == "bool" else [flag, _a_value(flag)]
        if flag in ours:
            outcomes["ours"] += 1
            continue
        try:
            left = translate(argv, ours, "epd serve")
        except ConfigError as err:
            message = str(err)
            assert "\n" not in message and flag in message, message
            outcomes["refused"] += 1
            continue
        assert left == [], (flag, left)  # taken out, value and all
        said = capsys.readouterr().err
        assert said.count("\n") == 1 and f"{flag}" in said and "accepted" in said, said
        outcomes["accepted"] += 1
    assert len(_vllm_flags()) >= 100 and min(outcomes.values()) > 5, outcomes


def _a_value(flag: str) -> str:
    rule = VLLM_FLAGS.get(flag)
    if isinstance(rule, Accepted) and rule.values:
        return rule.values[0]
    return "1"


@pytest.mark.parametrize("argv, expected", [
    (["--quantization", "awq"], "--quantization (vLLM's) is not supported: quantized checkpoints are not loaded here; "
                                "nearest here: --dtype"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 (vLLM's) is not supported: no quantized KV cache"),
    (["--max-modle-len", "5"], "unrecognized argument --max-modle-len (did you mean --max-model-len?)"),
    (["--tokenizer-revision", "main"], "--tokenizer-revision (vLLM's) is not supported: the tokenizer is the "
                                       "checkpoint's own"),
])
def test_a_flag_that_cannot_work_here_is_one_line_naming_it(argv, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        serve_config_from_args(["tiny-qwen2-vl", *argv])


def test_a_command_line_from_vllms_docs_for_qwen2_vl_runs_here(capsys):
    """vLLM's Qwen2-VL serve line, and the habits around it: what applies sets ours, what is so here
    already is said once each, the values land where ours would."""
    config = serve_config_from_args([
        "tiny-qwen2-vl", "--trust-remote-code", "--max-model-len", "2048", "--limit-mm-per-prompt", '{"image": 2}',
        "--dtype", "float32", "--tensor-parallel-size", "1", "--enforce-eager", "--served-model-name", "qwen",
        "--disable-log-requests", "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--load-format=safetensors",
        "--uvicorn-log-level", "info", "--generation-config", "vllm", "--gpu-memory-utilization", "0.9"])
    said = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in said] == ["--trust-remote-code", "--disable-log-requests",
                                                   "--enable-chunked-prefill", "--kv-cache-dtype", "--load-format"]
    assert all(line.startswith("epd serve: --") and "is vLLM's; accepted" in line for line in said), said
    router, engine = config.router, config.worker.engine
    assert (router.max_model_len, router.limit_mm_per_prompt, router.served_model_name) == (2048, {"image": 2},
                                                                                            ("qwen",))
    assert (engine.dtype, engine.enforce_eager, engine.gpu_memory_utilization) == ("float32", True, 0.9)
    assert (router.uvicorn_log_level, router.generation_config) == ("info", "vllm")


def test_a_bad_value_for_one_of_ours_is_one_line_not_the_usage(capsys):
    with pytest.raises(SystemExit) as stop:
        serve_command().parse_args(["--max-model-len"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith("epd serve: error: argument --max-model-len: expected one argument"), err


def test_the_table_only_names_flags_vllm_has():
    listed = {flag for flag, _ in _vllm_flags()}
    assert set(VLLM_FLAGS) - listed == set(), sorted(set(VLLM_FLAGS) - listed)
    assert all(isinstance(rule, Accepted | Refused) for rule in VLLM_FLAGS.values())


def test_the_docs_page_is_the_table():
    from epd.server.vllm_flags import table

    page = (Path(__file__).resolve().parents[1] / "docs" / "vllm-flags.md").read_text()
    assert page.split("<!-- table: generated -->\n", 1)[1] == table()


def test_epd_serve_stops_at_a_flag_it_cannot_honour_in_one_line_before_starting_anything():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "epd", "serve", "tiny-qwen2-vl", "--trust-remote-code",
                           "--quantization", "awq", "--port", "0", "--grpc-port", "0"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("epd serve: error: --quantization (vLLM's) is not supported: quantized checkpoints are not "
                         "loaded here; nearest here: --dtype"), done.stderr
    assert "starting" not in done.stdout and "Traceback" not in done.stderr
