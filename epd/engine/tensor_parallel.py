"""Tensor-parallel ranks of the in-process engine. Rank 0 is the process the engine runs in: it
schedules, prepares each step, runs its part of the model and samples. Ranks 1..N-1 are processes
of their own, each holding its part of the model (``epd.models.parallel``) and of the KV cache; they
run every step rank 0 sends them, and the model's collectives (an all-reduce per sublayer, the
logits' all-gather) join the ranks inside the forward.

A step crosses on the process group as raw tensors, three broadcasts: a header of sizes, every
integer input packed in one int64 buffer (token ids, positions, slots, page metadata, the rows' and
logits' indices), and the embedding rows when the step has any (rank 0 imported them: the ranks
never see a handle). Nothing is pickled. Rank 0's scheduler decides the pages and slots, so every
rank writes its KV heads into the same slots.

A KV hand-off between tiers always carries every KV head of the model, whatever either side's TP
size: an export (prefill) gathers each rank's heads into rank 0's copy, an import (decode) scatters
each rank exactly its heads (the one head it shares with other ranks when the model has fewer KV
heads than ranks). So a prefill at TP a feeds a decode at TP b for any a and b.

Backends: gloo on the CPU (the ranks meeting on 127.0.0.1); on CUDA one process group that sends
CPU tensors (the step's header and integers) over gloo and CUDA tensors (the model's collectives,
embedding rows, KV parts) over NCCL, one device per rank (``EngineConfig.rank_device``). Steps run
eager (a CUDA graph would have to be replayed by every rank). Every rank holds the same number of
KV pages: each sizes its cache (on CUDA from its device's memory, after one profiled step that
every rank runs together) and all take the smallest (``LLMEngine``). A failed step or a lost rank leaves the ranks out of step for good: every
later step is refused and the engine reports itself unhealthy, to be restarted (a worker process
stops at once: ``watch``).
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import os

import numpy as np
import torch
import torch.distributed as dist

from epd.engine.model_runner import StepInputs
from epd.engine.tp_rank import (
    DTYPES,
    OP_READ_KV,
    OP_STEP,
    OP_STOP,
    OP_WRITE_KV,
    OP_WRITE_KV_SHARED,
    START_TIMEOUT_S,
    group_backend,
    header,
    rank_main,
    use_device,
)

log = logging.getLogger("epd.engine")


class TensorParallelConfigError(ValueError):
    """A tensor-parallel size this engine cannot run (the message says what would work)."""


def check_supported(config) -> None:
    size = config.tensor_parallel_size
    if size > 1 and config.target_device.startswith("cuda"):
        _check_devices(config)
    if size > 1 and dist.is_initialized():
        raise TensorParallelConfigError(f"tensor_parallel_size {size}: this process already belongs to a "
                                        "process group (one tensor-parallel engine per process)")


def load_engine(model_dir, config, mm_token_ids: tuple[int, ...], build):
    """The engine of ``model_dir``: ``build(model)`` -> an ``LLMEngine``, run on the LLM loaded
    whole, or (``tensor_parallel_size`` > 1) on rank 0's part once ranks 1..N-1 are started, then
    returned once every rank has loaded; its runner holds the ranks (``LLMEngine.close`` stops them)."""
    from epd.models.registry import family_for, load_llm_for

    if config.tensor_parallel_size == 1:
        return build(load_llm_for(model_dir, config))
    check_runnable(model_dir, config)
    family = family_for(model_dir)
    ranks = RankGroup(model_dir, config, mm_token_ids)
    try:
        engine = build(family.load_llm(model_dir, device=config.target_device, dtype=config.torch_dtype,
                                       tp=ranks.tp))
        engine.runner.ranks = ranks
        ranks.wait_until_loaded()
    except BaseException:
        ranks.close()  # never raises: the error above is the one to see
        raise
    return engine


def check_runnable(model_dir, config, what: str = "tensor_parallel_size") -> None:
    """``config.tensor_parallel_size`` ranks of ``model_dir`` can run here, or an error saying what
    would (``TensorParallelConfigError`` or ``TensorParallelError``; both ValueErrors): checked
    before any rank starts, so a bad size is one line at start."""
    from pathlib import Path

    from epd.models.checkpoint import read_config
    from epd.models.parallel import TensorParallelError, check_cuttable
    from epd.models.registry import family_for

    size = config.tensor_parallel_size
    if size == 1:
        return
    check_supported(config)
    if not getattr(family_for(model_dir), "supports_tensor_parallel", False):
        raise TensorParallelError(f"{Path(model_dir).name}: its LLM is not cut into ranks ({what} {size}); use 1")
    hf_config = read_config(model_dir)
    try:
        check_cuttable(hf_config, size)
    except TensorParallelError as err:
        works = [n for n in range(1, 17) if _cuttable(hf_config, n)]
        raise TensorParallelError(f"{what} {size}: {err}; {Path(model_dir).name} runs at "
                                  f"{', '.join(map(str, works))}") from None


def _cuttable(hf_config: dict, size: int) -> bool:
    from epd.models.parallel import TensorParallelError, check_cuttable
    try:
        check_cuttable(hf_config, size)
    except TensorParallelError:
        return False
    return True


def _check_devices(config) -> None:
    """One CUDA device for each rank, each one this process can see."""
    size, seen = config.tensor_parallel_size, torch.cuda.device_count()
    devices = [config.rank_device(rank) for rank in range(size)]
    missing = [d for d in devices if int(d.partition(":")[2]) >= seen]
    if missing and seen == 0:
        raise TensorParallelConfigError(f"tensor_parallel_size {size} on {', '.join(devices)}: this process sees no "
                                        "CUDA device (CUDA_VISIBLE_DEVICES, driver); use --device cpu")
    if missing:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} on {', '.join(devices)}: this process sees {seen} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES), so {', '.join(missing)} is not there; use at most {seen} ranks or other devices")


class RankGroup:
    """Rank 0's side: starts ranks 1..N-1, joins the process group with them, sends each step,
    stops them (``close``). ``tp``: this process's ``TensorParallel`` (rank 0). Its size was
    checked first (``check_runnable``, in ``load_engine``)."""

    def __init__(self, model_dir, config, mm_token_ids: tuple[int, ...]) -> None:
        from epd.models.checkpoint import read_config
        from epd.models.parallel import HeadLayout, TensorParallel

        hf_config = read_config(model_dir)
        size = config.tensor_parallel_size
        text = {**hf_config, **hf_config.get("text_config", {})}
        # each rank's KV heads [first, first + n) of the model's: where its part of a hand-off goes
        self.kv_heads = [(layout.first_kv_head, layout.num_kv_heads) for layout in (
            HeadLayout.of(text["num_attention_heads"], text["num_key_value_heads"], TensorParallel(rank, size))
            for rank in range(size))]
        # the rendezvous store first, on a port the OS picks and it keeps: no window for another
        # process to take a port picked here and let go
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        port = store.port
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks are processes of this host
        ctx = multiprocessing.get_context("spawn")
        joining = ctx.Queue()
        self._procs = [ctx.Process(target=rank_main, name=f"epd-tp-rank{rank}", daemon=True,
                                   args=(str(model_dir), config.model_dump_json(), tuple(mm_token_ids), rank, size,
                                         port, joining)) for rank in range(1, size)]
        try:
            for proc in self._procs:
                proc.start()
            self._wait_until_joining(joining)
            use_device(config.rank_device(0))
            dist.init_process_group(group_backend(config), store=store, rank=0, world_size=size,
                                    timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        except BaseException:
            self._reap()
            raise
        self.tp = TensorParallel(0, size, dist.group.WORLD)
        self.device = torch.device(config.rank_device(0))
        self.failure: str | None = None  # set once the ranks can no longer run steps together
        self.num_kv_writes_shared = 0  # imported KVs each rank read from shared memory itself

    def wait_until_loaded(self) -> None:
        """Every rank built its part and its engine (rank 0 calls this once its own are built): a
        rank that failed to load is an error now, not at the first request."""
        try:
            dist.barrier()
        except RuntimeError as err:
            self.failure = f"a tensor-parallel rank failed while loading: {err}"
            raise RuntimeError(self.failure) from None

    @property
    def healthy(self) -> bool:
        return self.failure is None and all(p.is_alive() for p in self._procs)

    def check(self) -> None:
        """Before a step: the ranks must all be there (after a failed step or a lost rank they are
        out of step for good; the engine is to be restarted)."""
        if self.failure is None and not all(p.is_alive() for p in self._procs):
            dead = next(p for p in self._procs if not p.is_alive())
            self.failure = f"tensor-parallel rank {dead.name} exited (code {dead.exitcode})"
        if self.failure is not None:
            raise RuntimeError(f"{self.failure}; the engine must be restarted")

    def fail(self, err: BaseException) -> None:
        self.failure = self.failure or f"a step failed on the tensor-parallel ranks: {type(err).__name__}: {err}"

    def _wait_until_joining(self, joining) -> None:
        """Every rank started and is about to join the group; a rank that died first is an error
        now, not a wait for the group's timeout (a script that starts ranks must be importable
        without running itself: ``if __name__ == "__main__":``, as with any spawned process)."""
        import queue
        import time

        pending, deadline = {p.name for p in self._procs}, time.monotonic() + START_TIMEOUT_S
        while pending:
            try:
                pending.discard(joining.get(timeout=0.5))
            except queue.Empty:
                dead = [p for p in self._procs if p.name in pending and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"tensor-parallel rank process {dead[0].name} exited with code "
                                       f"{dead[0].exitcode} before joining (its error is above; a script "
                                       "needs 'if __name__ == \"__main__\":' around what it runs)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel ranks {sorted(pending)} did not start within "
                                       f"{START_TIMEOUT_S:.0f} s") from None

    def send_step(self, step: StepInputs) -> None:
        host = step.meta.host
        rows = torch.cat(step.mm_rows) if len(step.mm_rows) > 1 else (step.mm_rows[0] if step.mm_rows else None)
        ints = [step.input_ids, step.positions.reshape(-1), host.slot_mapping, host.query_start_loc, host.seq_lens,
                host.block_tables.reshape(-1), host.kv_indptr, host.kv_indices, host.kv_last_page_len,
                step.mm_token_indices, step.text_token_indices, step.logits_indices]
        # on the host, whatever the device: the step's integers travel over gloo (a CUDA tensor's copy
        # waits for what wrote it, e.g. input ids filled in from the last step's tokens)
        packed = torch.cat([(a.cpu() if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))).reshape(-1)
                            .to(torch.int64) for a in ints])
        header = torch.tensor([OP_STEP, step.input_ids.shape[0], len(host.seq_lens), step.meta.num_decodes,
                               host.block_tables.shape[1], len(host.kv_indices),
                               0 if rows is None else rows.shape[0], 0 if rows is None else rows.shape[1],
                               0 if rows is None else DTYPES.index(rows.dtype), len(step.logits_indices),
                               int(step.every_row_samples), packed.numel()], dtype=torch.int64)
        dist.broadcast(header, src=0)
        dist.broadcast(packed, src=0)
        if rows is not None:
            dist.broadcast(rows.to(self.device).contiguous(), src=0)

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor, source=None) -> torch.Tensor:
        """An imported KV [layers, 2, T, every KV head, head_dim] for ``slots``: each other rank gets
        its heads -> rank 0's. ``source``: the handle ``kv`` was imported from; in shared memory,
        each rank reads its own heads there (nothing passes through rank 0), else one scatter."""
        if source is not None and source.WhichOneof("body") == "shm" and self._write_kv_shared(slots, source):
            first, n = self.kv_heads[0]
            return kv[:, :, :, first:first + n]
        dist.broadcast(header(OP_WRITE_KV, len(slots), DTYPES.index(kv.dtype)), src=0)
        dist.broadcast(slots.to(torch.int64).contiguous(), src=0)
        parts = [kv[:, :, :, first:first + n].to(self.device).contiguous() for first, n in self.kv_heads]
        mine = torch.empty_like(parts[0])
        dist.scatter(mine, parts, src=0)
        return mine

    def _write_kv_shared(self, slots: torch.Tensor, source) -> bool:
        """Every other rank maps the handle's shared memory and writes its heads from there (rank 0
        holds the lease until they all said how it went) -> whether they all did (else nothing is
        lost: the scatter follows, and writes the same slots again)."""
        blob = source.SerializeToString()
        dist.broadcast(header(OP_WRITE_KV_SHARED, len(slots), len(blob)), src=0)
        dist.broadcast(slots.to(torch.int64).contiguous(), src=0)
        dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src=0)
        statuses = [torch.zeros(1, dtype=torch.int64) for _ in self.kv_heads]
        dist.gather(torch.zeros(1, dtype=torch.int64), statuses, dst=0)
        failed = sum(int(status) for status in statuses)
        if failed:
            log.warning("tensor-parallel ranks: %d rank(s) could not read lease %s's shared memory; sending them "
                        "their heads instead", failed, source.lease_id)
            return False
        self.num_kv_writes_shared += 1
        return True

    def read_kv(self, slots: torch.Tensor, out: torch.Tensor, read_local) -> None:
        """Every KV head at ``slots`` into ``out`` [layers, 2, T, every KV head, head_dim]: the other
        ranks read theirs while ``read_local(slots)`` reads rank 0's, then one gather. A head shared
        by several ranks is written once per rank, with the same values."""
        dist.broadcast(header(OP_READ_KV, len(slots), DTYPES.index(out.dtype)), src=0)
        dist.broadcast(slots.to(torch.int64).contiguous(), src=0)
        mine = read_local(slots)
        parts = [torch.empty_like(mine) for _ in self.kv_heads]
        dist.gather(mine, parts, dst=0)
        for (first, n), part in zip(self.kv_heads, parts):
            out[:, :, :, first:first + n] = part

    def watch(self, on_lost, interval_s: float = 0.25) -> None:
        """Call ``on_lost(reason)`` once, from a thread of its own, when a rank is lost or a step
        failed across the ranks, even while the engine is idle (a worker process stops then: its
        requests move to other workers and its supervisor starts it again)."""
        import threading
        import time

        def run() -> None:
            while self.failure != "closed":
                if not self.healthy:
                    on_lost(self.failure or next(f"tensor-parallel rank {p.name} exited (code {p.exitcode})"
                                                 for p in self._procs if not p.is_alive()))
                    return
                time.sleep(interval_s)

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def close(self) -> None:
        """The ranks stop (they leave their loop; one that cannot hear it is killed), then the
        process group goes. Never raises: it runs on the way out of other errors too."""
        if self.failure == "closed" or not dist.is_initialized():
            return
        try:
            if self.healthy:
                dist.broadcast(header(OP_STOP), src=0)
        except RuntimeError as err:  # a rank already gone: it is reaped below
            log.warning("tensor-parallel ranks: the stop did not reach every rank (%s)", err)
        finally:
            self.failure = "closed"
            self._reap()
            try:
                dist.destroy_process_group()
            except RuntimeError as err:
                log.warning("tensor-parallel ranks: destroying the process group: %s", err)

    def _reap(self) -> None:
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
