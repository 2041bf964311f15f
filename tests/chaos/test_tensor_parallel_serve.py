"""``epd serve`` with tensor-parallel workers, as a user starts them: a TP 2 prefill feeding a TP 1
decode, and a TP 1 prefill feeding TP 2 decodes, give transformers' greedy tokens on multi-image
chats (text and images interleaved, one image twice). A TP 2 decode worker whose second rank is
killed mid-stream costs no request: the worker stops at once, its requests move to the other decode
worker and the supervisor starts it again; afterwards nothing is left in /dev/shm or the process
table."""
from __future__ import annotations

import base64
import os
import signal
import time

import httpx
import pytest

from epd.bench.chaos import (
    LoopingClients,
    chats,
    get_json,
    in_rotation,
    mismatches,
    moves,
    references,
    restarted_pid,
    segments_of,
    worker_pids,
)
from epd.models.presets import write_preset_checkpoint
from tests.conftest import make_image_bytes
from tests.e2e.serve_process import ServeProcess, wait_until
from tests.fidelity.reference import ReferenceModel
from tests.procs import descendants, gone

pytestmark = pytest.mark.slow
MAX_NEW = 16
IMG_A, IMG_B = make_image_bytes(120, 90, seed=31), make_image_bytes(64, 100, seed=32)
# each chat as parts in order: text, or an image's bytes
CHATS = {"interleaved": ["Compare", IMG_A, "with", IMG_B, "please."],
         "same-image-twice": [IMG_B, "and again", IMG_B, "same?"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_preset_checkpoint("tiny-qwen2-vl", tmp_path_factory.mktemp("tp") / "ckpt", seed=1357)


@pytest.fixture(scope="module")
def expected(model_dir):
    """transformers' greedy tokens for each chat."""
    reference = ReferenceModel(model_dir)
    out = {}
    for name, parts in CHATS.items():
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
        images = [p for p in parts if not isinstance(p, str)]
        out[name] = reference.generate([{"role": "user", "content": content}], images, max_new_tokens=MAX_NEW).token_ids
    assert all(len(set(t)) > 3 for t in out.values()), "degenerate output makes the comparison meaningless"
    return out


def _greedy_tokens(base_url: str, model_dir) -> dict[str, list[int]]:
    out = {}
    with httpx.Client(timeout=120) as http:
        for name, parts in CHATS.items():
            content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(p).decode()}} for p in parts]
            body = {"model": str(model_dir), "messages": [{"role": "user", "content": content}],
                    "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            reply = http.post(f"{base_url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            out[name] = reply.json()["choices"][0]["token_ids"]
    return out


def _assert_all_gone(pids: set[int]) -> None:
    assert wait_until(lambda: all(gone(p) for p in pids), 20), [p for p in pids if not gone(p)]
    assert not [name for p in pids for name in segments_of(p)]


def test_a_tp2_prefill_feeding_a_tp1_decode_gives_transformers_tokens(model_dir, expected):
    serve = ServeProcess("--model", str(model_dir), "--prefill-tp", "2")
    started = descendants(serve.proc.pid)
    try:
        (_, prefill_pid), = worker_pids(serve.lines)["prefill"]
        assert len(descendants(prefill_pid)) >= 1  # its second rank
        assert _greedy_tokens(serve.base_url, model_dir) == expected
    finally:
        assert serve.stop() == 0, "\n".join(serve.lines[-30:])
    _assert_all_gone(started)


def test_tp2_decodes_give_transformers_tokens_and_a_lost_rank_costs_no_request(model_dir, expected):
    serve = ServeProcess("--model", str(model_dir), "--decode-tp", "2", "--decodes", "2",
                         "--health-timeout-s", "2")
    started = descendants(serve.proc.pid)
    try:
        assert _greedy_tokens(serve.base_url, model_dir) == expected
        chat_list = chats(max_tokens=32, seed=7)
        refs = references(serve.base_url, str(model_dir), chat_list)
        pids = worker_pids(serve.lines)
        address, decode_pid = pids["decode"][0]
        (rank1,) = [p for p in descendants(decode_pid) if b"spawn_main" in _cmdline(p)]
        with LoopingClients(serve.base_url, str(model_dir), chat_list, 4) as clients:
            assert wait_until(lambda: clients.num_ok >= 4, 90)
            # the kill must find a request on that worker (the router's count of its calls): one
            # that had none would cost nothing to lose, and the test would prove no move
            assert wait_until(lambda: _in_flight(serve.base_url, "decode", address) >= 1, 30, period_s=0.01)
            seen = len(serve.lines)
            os.kill(rank1, signal.SIGKILL)
            killed_at = time.monotonic()
            assert wait_until(lambda: gone(decode_pid), 30), "the decode worker did not stop when its rank died"
            assert wait_until(lambda: restarted_pid(serve.lines, "decode", address, seen) is not None
                              and in_rotation(serve.base_url, "decode", address), 90), \
                "\n".join(serve.lines[seen:][-20:])
            assert any("exited with 3" in line for line in serve.lines[seen:])
            done = clients.num_ok
            assert wait_until(lambda: clients.num_ok >= done + 4, 90)
            print(f"decode back in rotation {time.monotonic() - killed_at:.1f} s after its rank's kill")
        assert not clients.failures(), [f"{o.chat}: {o.status} {o.error}" for o in clients.failures()][:5]
        assert not mismatches(clients.snapshot(), refs)
        assert moves(serve.base_url).get("migrated", 0) >= 1, "no request was ever moved mid-stream"
        started |= descendants(serve.proc.pid)  # the restarted worker and its rank
    finally:
        assert serve.stop() == 0, "\n".join(serve.lines[-30:])
    _assert_all_gone(started)


def _in_flight(base_url: str, tier: str, address: str) -> int:
    workers = get_json(f"{base_url}/health").get("workers", {}).get(tier, [])
    return sum(w["in_flight"] for w in workers if w["address"] == address)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
