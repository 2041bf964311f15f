"""epd bench's workloads beyond the defaults: a JSONL dataset (epd/bench/datasets.py) and vLLM's
random-mm options (bucket config, range ratios)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from epd.bench.datasets import load_jsonl, take
from epd.bench.workload import WorkloadConfig, build_workload, parse_bucket_config, spread


def write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_a_dataset_reads_each_file_once_and_counts_repeats(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG-a")
    path = write(tmp_path / "d.jsonl", [{"prompt": "p1", "images": ["a.png", "https://example.com/x.jpg"]},
                                        {"prompt": "p2", "images": ["a.png"], "output_tokens": 7},
                                        {"prompt": "p3", "images": ["https://example.com/x.jpg"]}])
    requests = load_jsonl(path, default_output_len=11)
    assert [r.output_len for r in requests] == [11, 7, 11]
    assert requests[0].image_inputs == [b"\x89PNG-a", "https://example.com/x.jpg"]
    assert requests[1].image_inputs[0] is requests[0].image_inputs[0]  # one read, one object
    assert [r.num_repeated_images for r in requests] == [0, 1, 1]
    assert [r.num_images for r in requests] == [2, 1, 1]


def test_taking_more_than_the_dataset_goes_round_again_and_counts_it_repeated(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG-a")
    requests = load_jsonl(write(tmp_path / "d.jsonl", [{"prompt": "p1", "images": ["a.png"]}, {"prompt": "p2"}]),
                          default_output_len=4)
    taken = take(requests, 5)
    assert [r.prompt for r in taken] == ["p1", "p2", "p1", "p2", "p1"] and [r.index for r in taken] == list(range(5))
    assert [r.num_repeated_images for r in taken] == [0, 0, 1, 0, 1]
    assert [r.prompt for r in take(requests, None)] == ["p1", "p2"]


@pytest.mark.parametrize("rows,said", [
    (["not json"], "d.jsonl:1: not JSON"),
    ([["a list"]], "d.jsonl:1: expected an object"),
    ([{"prompt": "x"}, {"promt": "typo"}], "d.jsonl:2: unknown keys ['promt']"),
    ([{"prompt": ""}], "'prompt' must be a non-empty string"),
    ([{"prompt": "x", "images": "a.png"}], "'images' must be a list"),
    ([{"prompt": "x", "images": ["missing.png"]}], "images[0]: cannot read"),
    ([{"prompt": "x", "output_len": 0}], "output_len must be an integer >= 1"),
    ([{"prompt": "x", "output_len": 3, "max_tokens": 4}], "give one of"),
    ([], "has no requests"),
])
def test_a_bad_dataset_line_is_named_with_its_line(tmp_path, rows, said):
    with pytest.raises(ValueError) as err:
        load_jsonl(write(tmp_path / "d.jsonl", rows), default_output_len=4)
    assert said in str(err.value)


def test_vllm_bucket_config_is_sizes_with_weights_and_never_evaluated():
    sizes = parse_bucket_config("{(256, 320, 1): 0.75, (64, 64, 1): 0.25, (8, 8, 1): 0}")
    assert [(s.width, s.height, s.weight) for s in sizes] == [(320, 256, 0.75), (64, 64, 0.25)]
    for bad in ("__import__('os').system('true')", "{(1, 2): 1}", "[]", "{(2, 2, 1): -1}"):
        with pytest.raises(ValueError):
            parse_bucket_config(bad)


def test_range_ratios_spread_lengths_and_image_counts_within_their_bounds():
    rng = np.random.default_rng(0)
    values = spread(100, 0.5, 2000, rng)
    assert min(values) >= 50 and max(values) <= 150 and len(set(values)) > 50
    assert spread(100, 0.0, 3, rng) == [100, 100, 100]
    cfg = WorkloadConfig(num_prompts=400, input_len=40, output_len=20, images_per_request=2, range_ratio=0.5,
                         items_range_ratio=0.9, seed=1)
    requests = build_workload(cfg, 10.0, 1.0)
    counts = Counter(len(r.images) for r in requests)
    assert set(counts) == {1, 2, 3} and all(10 <= r.output_len <= 30 for r in requests)
    words = [len(r.prompt.split()) for r in requests]
    assert min(words) >= 20 and max(words) <= 60 and len(set(words)) > 10
    assert build_workload(cfg, 10.0, 1.0)[5].prompt == requests[5].prompt  # seeded


def test_sharegpt_conversations_from_a_json_array_or_lines(tmp_path):
    from epd.bench.datasets import load_sharegpt

    (tmp_path / "cat.png").write_bytes(b"\x89PNG-cat")
    rows = [{"id": "1", "image": "cat.png", "conversations": [
                {"from": "human", "value": "<image>\nWhat is in the picture?"},
                {"from": "gpt", "value": "A cat sitting on a warm windowsill in the sun"}]},
            {"id": "2", "conversations": [{"from": "human", "value": "Tell me a joke."}]}]
    as_array = tmp_path / "sharegpt.json"
    as_array.write_text(json.dumps(rows))
    for path in (str(as_array), write(tmp_path / "sharegpt.jsonl", rows)):
        requests = load_sharegpt(path, default_output_len=9)
        assert [r.prompt for r in requests] == ["What is in the picture?", "Tell me a joke."]
        assert requests[0].image_inputs == [b"\x89PNG-cat"] and requests[1].image_inputs == []
        assert [r.output_len for r in requests] == [13, 9]  # 10 words x 4/3; no reply: --output-len
    with pytest.raises(ValueError, match=r"sharegpt.jsonl:1: no human turn with text"):
        load_sharegpt(write(tmp_path / "sharegpt.jsonl", [{"conversations": [{"from": "gpt", "value": "hi"}]}]),
                      default_output_len=4)


def test_vision_arena_rows_nested_as_the_dataset_ships_them(tmp_path):
    from epd.bench.datasets import load_vision_arena

    (tmp_path / "a.png").write_bytes(b"\x89PNG-a")
    path = write(tmp_path / "arena.jsonl", [
        {"conversation": [[{"role": "user", "content": "Describe both."}, {"role": "assistant", "content": "x"}]],
         "images": [{"path": "a.png"}, "https://example.com/b.jpg"]},
        {"conversation": [{"role": "user", "content": "And this?"}], "images": ["a.png"]}])
    requests = load_vision_arena(path, default_output_len=128)
    assert [r.prompt for r in requests] == ["Describe both.", "And this?"]
    assert requests[0].image_inputs == [b"\x89PNG-a", "https://example.com/b.jpg"]
    assert [r.output_len for r in requests] == [128, 128] and requests[1].num_repeated_images == 1
    with pytest.raises(ValueError, match=r"arena.jsonl:1: expected 'conversation'"):
        load_vision_arena(write(tmp_path / "arena.jsonl", [{"messages": []}]), default_output_len=4)


def test_the_bench_targets_the_local_server_and_reads_the_openai_key_from_the_environment(monkeypatch):
    from epd.bench.cli import _check, build_parser

    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    parser = build_parser()
    args = parser.parse_args([])
    _check(args, parser)
    assert (args.base_url, args.api_key) == ("http://127.0.0.1:8000", "sk-from-env")
    args = parser.parse_args(["--api-key", "sk-given"])
    _check(args, parser)
    assert args.api_key == "sk-given"
    assert "sk-from-env" not in parser.format_help()  # a key never shows as a default
