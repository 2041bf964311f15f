"""The LLM cut across tensor-parallel ranks (epd.models.parallel, epd.engine.tensor_parallel) on the
CPU with gloo: rank 0 runs the engine, the other ranks their part of the model on every step it
sends; the greedy tokens equal transformers' (fp32) token for token, and a rank holds about 1/TP of
the weights. TP 4 on a model with 2 KV heads replicates each KV head on two ranks."""
from __future__ import annotations

import multiprocessing

import pytest

from epd.models.presets import write_preset_checkpoint
from tests.fidelity.reference import ReferenceModel, user_message

pytestmark = pytest.mark.slow

MAX_NEW = 16
CHATS = ["Describe a long and winding road in detail.", "Count the sheep, one by one, please."]


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen3-vl"])
def model_dir(request, tmp_path_factory):
    return str(write_preset_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=4321))


@pytest.fixture(scope="module")
def reference(model_dir):
    return ReferenceModel(model_dir)


@pytest.mark.parametrize("size", [2, 4])
def test_the_engine_in_ranks_gives_transformers_tokens_each_rank_holding_its_share(model_dir, reference, size):
    """Text chats at TP 2 and 4 (TP 4 on a model with 2 KV heads: each KV head on two ranks), and
    the weights rank 0 holds against the whole model's."""
    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.models.registry import family_for
    from epd.types import SamplingParams

    if size == 4 and "qwen3" in model_dir:
        pytest.skip("TP 4 is shown on Qwen2-VL (KV heads replicated); Qwen3-VL runs at TP 2")
    refs = [reference.generate(user_message(text, []), [], max_new_tokens=MAX_NEW) for text in CHATS]
    assert all(len(set(r.token_ids)) > 3 for r in refs), "degenerate output makes the comparison meaningless"
    whole_bytes = _weight_bytes(family_for(model_dir).load_llm(model_dir))
    config = EngineConfig(tensor_parallel_size=size, block_size=4, num_kv_blocks=512, max_num_batched_tokens=4096)
    with LLM(model_dir, engine_config=config) as llm:
        outs = llm.generate([r.prompt_token_ids for r in refs], SamplingParams(max_tokens=MAX_NEW))
        rank0_bytes = _weight_bytes(llm.engine.runner.model)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    # the vocabulary (embedding, head) and every projection are cut; norms stay whole
    assert rank0_bytes < whole_bytes / size * 1.1, (rank0_bytes, whole_bytes)


def test_epd_llm_in_two_ranks_gives_transformers_tokens_on_multi_image_chats(model_dir, reference):
    """``epd.LLM`` with ``tensor_parallel_size=2``: rank 0 runs the vision tower, schedules and
    samples, a second process holds the other half of the LLM and runs every step rank 0 sends
    (embedding rows included). Images interleaved with text and one image twice, as transformers
    answers them, with async scheduling (each step's inputs filled in from the last one's tokens
    before rank 0 sends them); the second rank is gone once the LLM is closed."""
    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.types import SamplingParams
    from tests.conftest import make_image_bytes

    image_a, image_b = make_image_bytes(120, 90, seed=5), make_image_bytes(64, 100, seed=6)
    chats = [[image_a, image_b], [image_a, image_a]]
    config = EngineConfig(tensor_parallel_size=2, block_size=4, num_kv_blocks=1024, max_num_batched_tokens=4096,
                          async_scheduling=True)
    with LLM(model_dir, engine_config=config) as llm:
        for images in chats:
            messages = user_message("Compare these, one by one.", images)
            out = llm.chat(messages, SamplingParams(max_tokens=MAX_NEW))[0]
            ref = reference.generate(messages, images, max_new_tokens=MAX_NEW)
            assert (out.prompt_token_ids, out.token_ids) == (ref.prompt_token_ids, ref.token_ids)
        assert llm.engine.num_overlapped_steps >= MAX_NEW
        rank_procs = [p for p in multiprocessing.active_children() if p.name.startswith("epd-tp-rank")]
        assert len(rank_procs) == 1
    assert not any(p.is_alive() for p in rank_procs)


def test_a_lost_rank_refuses_every_later_step_and_close_still_cleans_up(model_dir):
    """A rank killed between steps (its process gone): the next step is refused with what happened,
    not hung in a collective; the LLM says it is unhealthy; close() neither raises nor leaves a
    process behind."""
    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.types import SamplingParams

    if "qwen3" in model_dir:
        pytest.skip("one model shows it")
    config = EngineConfig(tensor_parallel_size=2, block_size=4, num_kv_blocks=256)
    llm = LLM(model_dir, engine_config=config)
    try:
        assert llm.healthy and llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))[0].token_ids
        (rank1,) = [p for p in multiprocessing.active_children() if p.name.startswith("epd-tp-rank")]
        rank1.kill()
        rank1.join(10)
        with pytest.raises(RuntimeError, match="epd-tp-rank1 exited.*must be restarted"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
        assert not llm.healthy
    finally:
        llm.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("epd-tp-rank")]


def _prefilled(model_dir, size: int, messages):
    """A prompt prefilled at TP ``size`` as the prefill tier does it: its first token, the KV of
    every prompt token (read out of the ranks, every KV head), and its M-RoPE delta."""
    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.types import SamplingParams

    config = EngineConfig(tensor_parallel_size=size, block_size=4, num_kv_blocks=1024, max_num_batched_tokens=4096)
    with LLM(model_dir, engine_config=config) as llm:
        seq = llm.add_conversation(messages, SamplingParams(max_tokens=2))
        for _ in range(100):
            if seq.num_output_tokens:
                break
            llm.engine.step()
        kv = llm.engine.runner.read_kv(seq.block_table, len(seq) - 1).clone()
        return seq.token_ids[:seq.num_prompt_tokens], seq.token_ids[-1], kv, seq.mm.mrope_delta


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 4), (4, 2)])
def test_kv_prefilled_at_one_tp_size_decodes_at_another_as_transformers_does(model_dir, reference, prefill_tp,
                                                                              decode_tp):
    """The prefill tier's KV export and the decode tier's import across TP sizes: heads split (1 -> 4:
    each KV head on two ranks), joined (2 -> 1) and both (4 -> 2), on a multi-image chat; the
    tokens after the hand-off are transformers' own."""
    from epd.config import EngineConfig
    from epd.engine.mm_inputs import SequenceMultimodal
    from epd.llm import LLM
    from epd.types import SamplingParams
    from tests.conftest import make_image_bytes

    if "qwen3" in model_dir:
        pytest.skip("the hand-off is the same for both families; Qwen2-VL shows it")
    images = [make_image_bytes(120, 90, seed=5), make_image_bytes(64, 100, seed=6)]
    messages = user_message("Compare these, one by one.", images)
    ref = reference.generate(messages, images, max_new_tokens=MAX_NEW)
    prompt, first, kv, delta = _prefilled(model_dir, prefill_tp, messages)
    assert kv.shape[3] == 2  # every KV head of the model travels, whatever the ranks
    config = EngineConfig(tensor_parallel_size=decode_tp, block_size=4, num_kv_blocks=1024)
    with LLM(model_dir, engine_config=config) as llm:
        seq = llm.engine.add_imported(prompt, SamplingParams(max_tokens=MAX_NEW), first_token_id=first,
                                      first_logprobs=None, kv=kv, mm=SequenceMultimodal.delta_only(delta),
                                      eos_token_ids=(llm.tokenizer.eos_token_id,))
        llm.engine.run_until_done([seq])
    assert (prompt, seq.output_token_ids) == (ref.prompt_token_ids, ref.token_ids)


def _smallest_on_rank(rank: int, port: int, value: int, out) -> None:
    import datetime

    import torch.distributed as dist

    from epd.models.parallel import TensorParallel

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        out.put((rank, TensorParallel(rank, 2, dist.group.WORLD).smallest(value)))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_smallest_kv_page_count():
    """Each rank sizes its KV cache on its own device (CUDA: from its free memory); rank 0's
    scheduler addresses every rank's pages, so all take the fewest (a rank with more would be
    fine, one with fewer would be written past its end)."""
    import datetime

    import torch.distributed as dist

    # the rendezvous store here, on a port the OS picks; both ranks meet on it
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_smallest_on_rank, args=(rank, port, value, out)) for rank, value in ((0, 900), (1, 640))]
    for proc in procs:
        proc.start()
    try:
        assert sorted(out.get(timeout=120) for _ in procs) == [(0, 640), (1, 640)]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def test_ranks_on_cuda_use_nccl_for_cuda_tensors_and_gloo_for_the_rest(monkeypatch):
    """The group's backend follows the device; a rank whose GPU this host does not have is one
    line before any rank starts."""
    import torch

    from epd.config import EngineConfig
    from epd.engine.tensor_parallel import TensorParallelConfigError, check_supported
    from epd.engine.tp_rank import group_backend

    assert group_backend(EngineConfig(device="cpu", tensor_parallel_size=2)) == "gloo"
    assert group_backend(EngineConfig(device="cuda:0", tensor_parallel_size=2)) == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_supported(EngineConfig(device="cuda:0", tensor_parallel_size=2))
    with pytest.raises(TensorParallelConfigError, match=r"sees 2 CUDA device\(s\).*cuda:2 is not there"):
        check_supported(EngineConfig(device="cuda:1", tensor_parallel_size=2))


def test_decode_ranks_read_their_heads_from_the_kv_handles_shared_memory(model_dir, reference):
    """A KV imported from shared memory (the decode tier's hand-off on one host): every rank maps
    the segment and writes its own heads from there (nothing passes through rank 0); a handle a rank
    cannot read (its lease already released) falls back to rank 0 sending the heads. Both answer as
    transformers does."""
    from epd.config import EngineConfig
    from epd.engine.mm_inputs import SequenceMultimodal
    from epd.llm import LLM
    from epd.transport import TensorStore, import_tensor, serve_tensor_store
    from epd.types import SamplingParams
    from tests.conftest import make_image_bytes

    if "qwen3" in model_dir:
        pytest.skip("the hand-off is the same for both families; Qwen2-VL shows it")
    images = [make_image_bytes(120, 90, seed=5), make_image_bytes(64, 100, seed=6)]
    messages = user_message("Compare these, one by one.", images)
    ref = reference.generate(messages, images, max_new_tokens=MAX_NEW)
    prompt, first, kv, delta = _prefilled(model_dir, 1, messages)
    store = TensorStore()
    server = serve_tensor_store(store)
    try:
        imported = import_tensor(store.export(kv, transport="shm", ttl_s=60))
        stale = import_tensor(store.export(kv.clone(), transport="shm", ttl_s=60))
        stale_handle, stale_kv = stale.handle, stale.tensor.clone()
        stale.release()  # its segment no longer serves the lease: the ranks cannot read it there
        config = EngineConfig(tensor_parallel_size=4, block_size=4, num_kv_blocks=1024)
        with LLM(model_dir, engine_config=config) as llm:
            seqs = [llm.engine.add_imported(prompt, SamplingParams(max_tokens=MAX_NEW), first_token_id=first,
                                            first_logprobs=None, kv=tensor, mm=SequenceMultimodal.delta_only(delta),
                                            eos_token_ids=(llm.tokenizer.eos_token_id,), kv_source=handle)
                    for tensor, handle in ((imported.tensor, imported.handle), (stale_kv, stale_handle))]
            llm.engine.run_until_done(seqs)
            shared = llm.engine.runner.ranks.num_kv_writes_shared
        imported.release()
    finally:
        server.stop(0)
        store.close()
    assert shared == 1  # the first read in place, the stale one sent by rank 0
    for seq in seqs:
        assert (prompt, seq.output_token_ids) == (ref.prompt_token_ids, ref.token_ids)
