"""The ranks 1..N-1 of a tensor-parallel engine (``epd.engine.tensor_parallel`` is rank 0's side)
and the step protocol both sides speak: each operation starts with a fixed-size int64 header
broadcast from rank 0 (the operation and its sizes), then the tensors it names; nothing is pickled.
A rank is a process of its own: it loads its part of the model, sizes its KV cache as rank 0 does,
and runs what rank 0 sends until it says stop or goes away.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import os

import torch
import torch.distributed as dist

from epd import heap
from epd.engine.attention.metadata import HostPageMetadata, metadata_on
from epd.engine.model_runner import StepInputs

log = logging.getLogger("epd.engine")
HEADER_LEN = 12
OP_STEP, OP_STOP, OP_WRITE_KV, OP_READ_KV, OP_WRITE_KV_SHARED = 1, 2, 3, 4, 5
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the ranks block in a broadcast between steps: an engine idle for hours must not time them out
GROUP_TIMEOUT = datetime.timedelta(days=30)
START_TIMEOUT_S = 300.0


def group_backend(config) -> str:
    """gloo for CPU tensors; on CUDA, NCCL for the CUDA tensors of the same group."""
    return "cpu:gloo,cuda:nccl" if config.target_device.startswith("cuda") else "gloo"


def use_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)


def header(op: int, *fields: int) -> torch.Tensor:
    return torch.tensor([op, *fields] + [0] * (HEADER_LEN - 1 - len(fields)), dtype=torch.int64)


def serve_rank(runner) -> None:
    """A rank (>= 1): what rank 0 sends, until it says stop (a lost rank 0 ends it with an error)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0)
        fields = header.tolist()
        op = fields[0]
        if op == OP_STOP:
            return
        if op == OP_STEP:
            runner.forward(_receive_step(runner, fields))
            continue
        slots = torch.empty(fields[1], dtype=torch.int64)
        dist.broadcast(slots, src=0)
        if op == OP_WRITE_KV_SHARED:
            _write_kv_shared(runner, slots, fields[2])
        elif op == OP_WRITE_KV:
            k0 = runner.kv_cache.k[0]
            mine = torch.empty((len(runner.kv_cache.k), 2, fields[1], *k0.shape[1:]), dtype=DTYPES[fields[2]],
                               device=runner.device)
            dist.scatter(mine, None, src=0)
            runner.write_kv_at(slots, mine)
        elif op == OP_READ_KV:
            dist.gather(runner.read_kv_at(slots), None, dst=0)
        else:
            raise RuntimeError(f"tensor-parallel rank: unknown operation {op} from rank 0")


def _write_kv_shared(runner, slots: torch.Tensor, handle_bytes: int) -> None:
    """This rank's heads of an imported KV, read from the handle's shared memory (rank 0 holds the
    lease meantime); its status (0: written) goes back to rank 0 whatever happened."""
    from epd.models.parallel import HeadLayout
    from epd.transport.base import ImportContext
    from epd.transport.handles import check_header
    from epd.transport.shm import ShmTransport
    from epd.v1 import tensor_pb2

    blob = torch.empty(handle_bytes, dtype=torch.uint8)
    dist.broadcast(blob, src=0)
    status = torch.zeros(1, dtype=torch.int64)
    try:
        handle = tensor_pb2.TensorHandle.FromString(blob.numpy().tobytes())
        dtype, shape = check_header(handle)
        kv = ShmTransport().import_(handle, dtype, shape, ImportContext(torch.device("cpu"), None, 0.0))
        cfg = runner.model.config
        layout = HeadLayout.of(cfg.num_attention_heads, cfg.num_key_value_heads, runner.model.tp)
        first, n = layout.first_kv_head, layout.num_kv_heads
        runner.write_kv_at(slots, kv[:, :, :, first:first + n].to(runner.device))
    except Exception as err:  # noqa: BLE001 - rank 0 sends the heads instead
        log.warning("tensor-parallel rank %d: reading an imported KV from shared memory failed: %s",
                    runner.model.tp.rank, err)
        status[0] = 1
    dist.gather(status, None, dst=0)


def _receive_step(runner, header: list[int]) -> StepInputs:
    """The rest of a step whose header came."""
    _, t, b, num_decodes, width, k, r, d, dtype_code, num_logits, every_row, total = header
    packed = torch.empty(total, dtype=torch.int64)
    dist.broadcast(packed, src=0)
    sizes = [t, 3 * t, t, b + 1, b, b * width, b + 1, k, b, r, t - r, num_logits]
    parts = list(packed.split(sizes))
    rows = None
    if r:
        rows = torch.empty(r, d, dtype=DTYPES[dtype_code], device=runner.device)
        dist.broadcast(rows, src=0)
    input_ids, positions, slots, qsl, seq_lens, tables, indptr, indices, last_len, mm_idx, text_idx, logits_idx = parts
    i32 = lambda x: x.to(torch.int32).numpy()  # noqa: E731
    host = HostPageMetadata(query_start_loc=i32(qsl), seq_lens=i32(seq_lens), block_tables=i32(tables).reshape(b, width),
                            kv_indptr=i32(indptr), kv_indices=i32(indices), kv_last_page_len=i32(last_len),
                            slot_mapping=slots.numpy())
    meta = metadata_on(host, host.slot_mapping, num_decodes, runner.block_size, runner.kv_pages, runner._to_device)
    return StepInputs(input_ids=input_ids, positions=positions.reshape(3, t), meta=meta,
                      mm_rows=[rows] if rows is not None else [], mm_token_indices=mm_idx, text_token_indices=text_idx,
                      logits_indices=logits_idx, sampling_seqs=[], every_row_samples=bool(every_row))


def rank_main(model_dir: str, config_json: str, mm_token_ids: tuple[int, ...], rank: int, size: int,
               port: int, joining) -> None:
    """Rank ``rank`` (>= 1): its part of the model and an engine of the same size as rank 0's (the
    same pages), then every step rank 0 sends, until it says stop or goes away."""
    from epd.config import EngineConfig
    from epd.engine.llm_engine import LLMEngine
    from epd.engine.threads import apply_thread_policy
    from epd.models.parallel import TensorParallel
    from epd.models.registry import family_for

    heap.own()  # a rank is a process of its own, whoever started it
    config = EngineConfig.model_validate_json(config_json)
    device = config.rank_device(rank)
    apply_thread_policy(f"epd tensor-parallel rank {rank}", override=config.num_threads)
    _exit_with_parent()
    joining.put(multiprocessing.current_process().name)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    use_device(device)
    dist.init_process_group(group_backend(config), store=store, rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        model = family_for(model_dir).load_llm(model_dir, device=device, dtype=config.torch_dtype, tp=tp)
        config = config.model_copy(update={"device": device, "tensor_parallel_devices": ()})
        runner = LLMEngine(model, config, eos_token_ids=(), mm_token_ids=mm_token_ids).runner
        heap.settle_for_serving()
        dist.barrier()  # loaded: rank 0 waits for this before it takes requests
        serve_rank(runner)
    finally:
        dist.destroy_process_group()
        heap.freeze_for_exit()


def _exit_with_parent() -> None:
    """A rank whose rank 0 died goes too (before the group exists nothing else would tell it: it
    would wait for the group's rendezvous)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
