"""What a CUDA machine says about EPD, as one JSON file (``scripts/gpu_verify.sh`` runs it).

    python scripts/gpu_bench.py --out results.json [--only env,fidelity,decode,ipc,encoder] [--dry-run]
                                [--deadline-s 450]

Phases, in this order, each recorded as it ends (the JSON is rewritten after every one, and the
decode phase after every row, so a run cut short keeps what it measured; a phase that fails
records its error and the next one runs; decode, the longest, goes last):
  env       torch / CUDA versions, the device, its copy bandwidth and bf16 matmul rate (the ceilings)
  fidelity  the engine on the device against the engine on the CPU (fp32 greedy token ids, one
            image), bf16 first-token logits against fp32 at > 3,000 prompt tokens, seeded sampling
  ipc       a tensor from a producer process: cuda_ipc vs shm by size (consumer's import + first
            read), and whether exports never imported stay allocated after their lease ends
  encoder   a Qwen2.5-VL-7B-sized vision tower over 1-8 images: eager vs CUDA-graph replay, capture
            time, replay's error against eager
  decode    decode tokens/s at batch 32 and 128 of a 1.5B- and a 7B-shaped LLM (random bf16 weights
            made on the device), against the floor of reading weights + KV once per step
``--dry-run``: the same code on the CPU with tiny shapes, to check the script itself (CI runs it).
A phase (or a decode row) that would start past ``--deadline-s`` is skipped and says so. The
script imports EPD (and with it transformers) inside ``main``: a failing import is recorded in the
JSON as ``import_error`` rather than lost.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

GiB, MiB = 1024**3, 1024**2
# (hidden, intermediate, layers, heads, kv heads): Qwen2-1.5B's and Qwen2-VL-7B's language models
SHAPES = {"1.5b": (1536, 8960, 28, 12, 2), "7b": (3584, 18944, 28, 28, 4)}
DRY_SHAPES = {"tiny": (64, 128, 2, 4, 2)}


class Run:
    def __init__(self, out: Path, dry_run: bool, deadline_s: float) -> None:
        self.out, self.dry_run = out, dry_run
        self.deadline = time.monotonic() + deadline_s
        self.device = "cpu" if dry_run else "cuda"
        self.results: dict = {"dry_run": dry_run, "phases": {}}
        self._work: Path | None = None

    @property
    def work(self) -> Path:
        """A folder for the checkpoints the phases write (made at the first use; ``close`` removes it)."""
        if self._work is None:
            self._work = Path(tempfile.mkdtemp(prefix="epd-gpu-bench-"))
        return self._work

    def close(self) -> None:
        if self._work is not None:  # ~200 MB of checkpoints: none is left behind
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    @property
    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def partial(self, name: str, data: dict) -> None:
        """What a long phase measured so far, on disk before it goes on."""
        self.results["phases"][name] = {"partial": True, **data}
        self.out.write_text(json.dumps(self.results, indent=2))

    def phase(self, name: str, fn) -> None:
        if self.past_deadline:
            self.results["phases"][name] = {"skipped": "past the deadline"}
        else:
            start = time.monotonic()
            try:
                self.results["phases"][name] = {"ok": True, **fn(self)}
            except Exception as err:  # noqa: BLE001 - recorded; the next phase still runs
                self.results["phases"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                                "trace": traceback.format_exc()[-3000:]}
            self.results["phases"][name]["seconds"] = round(time.monotonic() - start, 1)
        self.out.write_text(json.dumps(self.results, indent=2))
        print(f"[{name}] {json.dumps(self.results['phases'][name])[:600]}", flush=True)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def _median_s(fn, repeats: int, sync) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ---- env -----------------------------------------------------------------------------------------
def env(run: Run) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    if run.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / GiB, 1))
    nbytes, n = (16 * MiB, 512) if run.dry_run else (2 * GiB, 8192)
    src = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), 5, run.sync)
    dtype = torch.float32 if run.dry_run else torch.bfloat16
    a, b = (torch.randn(n, n, device=run.device, dtype=dtype) for _ in range(2))
    matmul_s = _median_s(lambda: a @ b, 5, run.sync)
    # a copy reads and writes every byte
    out.update(copy_gb_s=round(2 * nbytes / copy_s / 1e9, 1), matmul_tflop_s=round(2 * n**3 / matmul_s / 1e12, 1))
    run.results["bandwidth_gb_s"] = out["copy_gb_s"]
    return out


# ---- fidelity ------------------------------------------------------------------------------------
def fidelity(run: Run) -> dict:
    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.models.presets import write_preset_checkpoint
    from epd.types import SamplingParams
    from tests.conftest import make_image_bytes

    if run.device == "cuda":  # float32 against the CPU: no TF32 in cuDNN's convolutions (the patch embedding)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = write_preset_checkpoint("small-qwen2-vl", run.work / "small", seed=31)
    image = make_image_bytes(224, 168, seed=12)
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    cpu = LLM(str(model_dir), engine_config=EngineConfig(device="cpu", dtype="float32")).chat(chat, greedy)[0]
    # a KV size given: several engines live on the device at once here (none given: each takes 0.9 of it)
    dev = LLM(str(model_dir), engine_config=EngineConfig(device=run.device, dtype="float32", kv_cache_bytes=256 << 20))
    ids = dev.chat(chat, greedy)[0].token_ids
    same = [a == b for a, b in zip(cpu.token_ids, ids)]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=7)
    seeded_ids = dev.chat(chat, seeded)[0].token_ids  # raised on CUDA before the sampler's fix
    # > 3,000 prompt tokens on a GPU, where bf16's error grows with the context; a few hundred in the
    # dry run (the CPU computes them: the same check, a tenth of the time)
    words = " ".join(f"word{i % 97}" for i in range(100 if run.dry_run else 1150))
    long_chat = [{"role": "user", "content": [{"type": "image", "image": image},
                                              {"type": "text", "text": f"Read this. {words}"}]}]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(model_dir), engine_config=EngineConfig(device=run.device, dtype=dtype, max_model_len=8192,
                                                             max_num_batched_tokens=1024, kv_cache_bytes=256 << 20))
        captured = []
        sample = llm.engine.sampler

        def capture(rows, seqs, sample=sample, captured=captured):
            if len(seqs):
                captured.append(rows.float().cpu())
            return sample(rows, seqs)

        llm.engine.sampler = capture
        num_prompt = len(llm.chat(long_chat, SamplingParams(max_tokens=1, temperature=0.0))[0].prompt_token_ids)
        logits[dtype] = captured[0][0]
    a, b = logits["float32"], logits["bfloat16"]
    cosine = torch.nn.functional.cosine_similarity(a - a.mean(), b - b.mean(), dim=0).item()
    return {"device_vs_cpu_fp32_greedy_identical": all(same) and len(ids) == len(cpu.token_ids),
            "first_divergence": next((i for i, ok in enumerate(same) if not ok), None),
            "seeded_sampling_tokens": len(seeded_ids),
            "bf16_vs_fp32_first_token_cosine": round(cosine, 5), "bf16_prompt_tokens": num_prompt,
            "bf16_same_top_token": bool(a.argmax() == b.argmax())}


# ---- decode --------------------------------------------------------------------------------------
def _random_llm(shape: tuple, device: str, dtype: torch.dtype):
    from epd.models.qwen2_vl.llm import Qwen2ForCausalLM, Qwen2TextConfig

    hidden, inter, layers, heads, kv = shape
    half = hidden // heads // 2
    cfg = Qwen2TextConfig(vocab_size=151_936 if hidden > 64 else 1024, hidden_size=hidden, intermediate_size=inter,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                          mrope_section=(half // 4, 3 * half // 8, 3 * half // 8),  # Qwen2-VL's 16/24/24
                          tie_word_embeddings=False, max_position_embeddings=32768)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.eval()


def _free_device_memory(run: Run) -> None:
    """Engines hold reference cycles: without a collection a finished row's model and KV stay
    allocated, and the next (7B) row runs out of memory."""
    gc.collect()
    if run.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the next row's peak only


def _decode_rate(run: Run, shape: tuple, batch: int, prompt_len: int, steps: int, backend: str = "auto",
                 eager: bool = False) -> dict:
    _free_device_memory(run)
    model = _random_llm(shape, run.device, torch.float32 if run.dry_run else torch.bfloat16)
    try:
        return _timed_decode(run, model, batch, prompt_len, steps, backend, eager)
    finally:
        del model
        _free_device_memory(run)


def _timed_decode(run: Run, model, batch: int, prompt_len: int, steps: int, backend: str, eager: bool,
                  overlap: bool = False, outputs: list | None = None) -> dict:
    """``overlap``: async scheduling; ``outputs``: gets each sequence's tokens so far."""
    from epd.config import EngineConfig
    from epd.engine.llm_engine import LLMEngine
    from epd.types import SamplingParams

    dtype = torch.float32 if run.dry_run else torch.bfloat16
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    budget_tokens = max(2048, prompt_len)
    # sequences start decoding while later ones are still prefilled (a step per budget of prompt
    # tokens): every one must still be running through the warm-up and timed steps
    max_tokens = steps + 2 + -(-batch * prompt_len // budget_tokens) + 8
    context = prompt_len + max_tokens
    engine = LLMEngine(model, EngineConfig(device=run.device, dtype="float32" if run.dry_run else "bfloat16",
                                           max_num_seqs=batch, max_model_len=context + 16,
                                           max_num_batched_tokens=budget_tokens,
                                           kv_cache_bytes=int(kv_per_token * batch * (context + 32) * 1.1),
                                           attention_backend=backend, enforce_eager=eager,
                                           async_scheduling=overlap),
                       eos_token_ids=())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    seqs = [engine.add_request(torch.randint(0, cfg.vocab_size, (prompt_len,), generator=generator).tolist(), params)
            for _ in range(batch)]
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    for _ in range(2):  # warm-up steps
        engine.step()
    run.sync()
    running = []
    start = time.perf_counter()
    for _ in range(steps):
        running.append(len(engine.scheduler.running))  # each makes one token in this step
        engine.step()
    run.sync()
    elapsed_s = time.perf_counter() - start
    step_s = elapsed_s / steps
    kv_bytes = batch * (prompt_len + steps // 2) * kv_per_token
    bandwidth = run.results.get("bandwidth_gb_s", 4300.0) * 1e9
    floor_s = (weight_bytes + kv_bytes) / bandwidth
    if outputs is not None:
        outputs.extend(seq.output_token_ids for seq in seqs)
    out = {"batch": batch, "backend": engine.runner.attention_backend, "graphs": engine.runner.graphs is not None,
           "overlapped_steps": engine.num_overlapped_steps,
           "running_min": min(running), "ms_per_step": round(step_s * 1e3, 2),
           "tok_s": round(sum(running) / elapsed_s, 1),
           "floor_ms": round(floor_s * 1e3, 2), "fraction_of_floor": round(floor_s / step_s, 3)}
    if run.device == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
    return out


def _variants(run: Run, first_shape: bool) -> list[tuple[str, bool]]:
    """(attention backend, eager) runs: on the first (smaller) shape every backend there is, with
    and without decode graphs; on the 7B shape the default (auto) and the SDPA reference."""
    if run.dry_run:
        return [("sdpa", True)]
    have_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if not first_shape:  # without FlashInfer auto is SDPA: one row says it
        return [("auto", False), ("sdpa", True)] if have_flashinfer else [("sdpa", True)]
    return [("sdpa", True), ("flex", True)] + ([("flashinfer", True), ("flashinfer", False)] if have_flashinfer else [])


def decode(run: Run) -> dict:
    shapes = DRY_SHAPES if run.dry_run else SHAPES
    batches, prompt_len, steps = ((4,), 32, 4) if run.dry_run else ((32, 128), 512, 20)
    out = {}
    for n, (name, shape) in enumerate(shapes.items()):
        rows = out[name] = []
        for backend, eager in _variants(run, n == 0):
            for b in batches:
                if run.past_deadline:
                    rows.append({"batch": b, "backend": backend, "eager": eager, "skipped": "past the deadline"})
                    continue
                try:
                    rows.append(_decode_rate(run, shape, b, prompt_len, steps, backend, eager))
                except Exception as err:  # noqa: BLE001 - one backend failing must not hide the others
                    rows.append({"batch": b, "backend": backend, "eager": eager, "error": f"{type(err).__name__}: {err}"})
                run.partial("decode", out)
    return out


def overlap(run: Run) -> dict:
    """Async scheduling against steps in order, the same model and batch, one after the other: ms
    per decode step, and whether the greedy tokens are the same (compared as far as both got)."""
    shape = next(iter((DRY_SHAPES if run.dry_run else SHAPES).values()))
    batches, prompt_len, steps = ((4,), 32, 6) if run.dry_run else ((32, 128), 512, 40)
    out = {}
    for b in batches:
        if run.past_deadline:
            out[str(b)] = {"skipped": "past the deadline"}
            continue
        _free_device_memory(run)
        model = _random_llm(shape, run.device, torch.float32 if run.dry_run else torch.bfloat16)
        rows, tokens = {}, {}
        for name, on in (("in_order", False), ("async", True)):
            tokens[name] = []
            rows[name] = _timed_decode(run, model, b, prompt_len, steps, "auto", False, overlap=on,
                                       outputs=tokens[name])
            _free_device_memory(run)
        del model
        same = all(a[:min(len(a), len(c))] == c[:min(len(a), len(c))] for a, c in zip(tokens["in_order"],
                                                                                     tokens["async"]))
        out[str(b)] = {**rows, "same_tokens": same,
                       "async_over_in_order": round(rows["async"]["ms_per_step"] / rows["in_order"]["ms_per_step"], 3)}
        run.partial("overlap", out)
    return out


# ---- ipc -----------------------------------------------------------------------------------------
def _handoff_ms(run: Run, producer, transport: str, nbytes: int) -> float:
    """Median of 5: import a fresh export of ``nbytes`` and read its last element."""
    from epd.transport import import_tensor

    samples = []
    for seed in range(5):
        handle = producer.export(transport, "float32", (nbytes // 4,), seed=seed, device=run.device)
        start = time.perf_counter()
        with import_tensor(handle, device=run.device) as imported:
            float(imported.tensor[-1])  # the first read waits for the bytes
            run.sync()
            samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1e3, 3)


def ipc(run: Run) -> dict:
    from tests.transport.helpers import ProducerProcess

    sizes = [4 * 1024, MiB] if run.dry_run else [4 * 1024, MiB, 16 * MiB, 128 * MiB, GiB]
    transports = ["shm"] if run.dry_run else ["cuda_ipc", "shm"]
    producer = ProducerProcess()
    out: dict = {}
    try:
        for transport in transports:
            rows = []
            for nbytes in sizes:
                try:
                    rows.append({"bytes": nbytes, "ms": _handoff_ms(run, producer, transport, nbytes)})
                except Exception as err:  # noqa: BLE001 - one size failing must not lose the others
                    rows.append({"bytes": nbytes, "error": f"{type(err).__name__}: {err}"})
            out[transport] = rows
        if not run.dry_run:  # exports never imported must be freed when their lease ends
            before = producer.cuda_memory()
            for seed in range(8):
                producer.export("cuda_ipc", "float32", (16 * MiB,), seed=seed, device="cuda:0", ttl_s=1.0)
            time.sleep(3.0)  # the leases' TTL, and the sweeper's pass
            out["never_imported"] = {"exported_bytes": 8 * 64 * MiB, "leases_open_after_ttl": producer.stats()[0],
                                     "producer_cuda_bytes_still_held": producer.cuda_memory() - before}
    finally:
        producer.stop()
    return out


# ---- encoder -------------------------------------------------------------------------------------
# Qwen2.5-VL-7B's vision tower (the merger's output width stays the tiny preset's: it is one matmul)
VISION_7B = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
             "fullatt_block_indexes": [7, 15, 23, 31]}


def _vision_checkpoint(run: Run, dims: dict) -> Path:
    """A Qwen2.5-VL checkpoint holding only a vision tower of ``dims`` with random weights: the
    tiny preset's configs, the tower resized, its weights made on the device and saved once."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from epd.models.presets import write_preset_checkpoint
    from epd.models.qwen2_vl.vision import tower_class

    path = write_preset_checkpoint("tiny-qwen2.5-vl", run.work / "vision", seed=3)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"].update(dims)
    (path / "config.json").write_text(json.dumps(config))
    with torch.device(run.device):  # random init where it is fast
        tower = tower_class(config["model_type"])._from_config(AutoConfig.from_pretrained(path).vision_config)
    state = {f"visual.{name}": t.detach().to(torch.bfloat16 if dims else torch.float32).contiguous()
             for name, t in tower.state_dict().items()}
    save_file({name: t.cpu() for name, t in state.items()}, str(path / "model.safetensors"))
    return path


def encoder(run: Run) -> dict:
    """A 7B-sized tower over 1, 4, 5 and 8 images of 1,024 patches: eager against CUDA-graph replay
    (buckets of 1,024 x 1, 4,096 x 4 and 8,192 x 8 tokens x contexts), capture time, and how far
    replay's rows are from eager's. The dry run times the tiny tower eager only (graphs need CUDA)."""
    from epd.encoder.graphed_model import GraphedVisionEncoder
    from epd.models.qwen2_vl.vision import QwenVisionEncoder
    from tests.conftest import make_image_bytes

    dims, counts, side = ({}, (1, 2), 112) if run.dry_run else (VISION_7B, (1, 4, 5, 8), 448)
    dtype = torch.float32 if run.dry_run else torch.bfloat16
    model = QwenVisionEncoder(_vision_checkpoint(run, dims), dtype=dtype, device=run.device)
    images = [make_image_bytes(side, side, seed=i) for i in range(max(counts))]
    out: dict = {"tower": dims or "tiny-qwen2.5-vl", "image_px": side}
    graphed = None
    if run.device == "cuda":
        start = time.perf_counter()
        graphed = GraphedVisionEncoder(model, ((1024, 1), (4096, 4), (8192, 8)), device=run.device)
        out["capture_s"] = round(time.perf_counter() - start, 2)
    rows = []
    for n in counts:
        pixel_values, grid_thw = model.preprocess(images[:n])
        row = {"images": n, "tokens": int(grid_thw.prod(dim=-1).sum()),
               "eager_ms": round(_median_s(lambda: model.encode(pixel_values, grid_thw), 3, run.sync) * 1e3, 2)}
        if graphed is not None:
            before = graphed.num_graph_batches
            row["graph_ms"] = round(_median_s(lambda: graphed.encode(pixel_values, grid_thw), 3, run.sync) * 1e3, 2)
            row["replayed"] = graphed.num_graph_batches > before  # False: no bucket fit, it ran eager
            eager = model.encode(pixel_values, grid_thw)
            replayed = graphed.encode(pixel_values, grid_thw)
            row["max_rel_error"] = max(float((g.float() - e.float()).abs().max() / e.float().abs().max())
                                       for g, e in zip(replayed, eager, strict=True))
        rows.append(row)
    out["rows"] = rows
    return out


def tensor_parallel(run: Run) -> dict:
    """TP 2 against TP 1 on the same prompt (greedy tokens equal, and the time of each): on CUDA
    (NCCL ranks, one GPU each) where this host has two GPUs or more, and always the gloo ranks on
    this host's cores (the CPU path the tests run)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out: dict = {"gpus": gpus}
    prompt = [[1000 + 7 * i for i in range(64)]]
    if gpus >= 2 and not run.dry_run:
        out["cuda"] = _tp1_against_tp2(prompt, dict(device="cuda:0", dtype="bfloat16", kv_cache_bytes=256 * 2**20))
    else:
        out["cuda"] = f"skipped: {gpus} GPU(s); TP over GPUs needs 2 or more"
    out["cpu"] = _tp1_against_tp2(prompt, dict(device="cpu", dtype="float32"))
    out["ok"] = all(part["ok"] for part in (out["cuda"], out["cpu"]) if isinstance(part, dict))
    return out


def _tp1_against_tp2(prompt, engine: dict) -> dict:
    import time

    from epd.config import EngineConfig
    from epd.llm import LLM
    from epd.models.locate import resolve_model
    from epd.types import SamplingParams

    params, tokens, out = SamplingParams(max_tokens=16, ignore_eos=True), {}, {}
    for size in (1, 2):
        start = time.perf_counter()
        with LLM(str(resolve_model("tiny-qwen2-vl")),
                 engine_config=EngineConfig(**engine, tensor_parallel_size=size)) as llm:
            tokens[size] = llm.generate(prompt, params)[0].token_ids
        out[f"tp{size}_s"] = round(time.perf_counter() - start, 2)  # start, load and generate
    out["ok"] = tokens[1] == tokens[2]
    return out


def profile(run: Run) -> dict:
    """``epd profile`` on this device (a small grid; the dry run a tiny one): the first GPU run yields
    a GPU profile, the planner's input, written beside the results as profile.json."""
    from epd.bench.profile import main as profile_main

    if run.dry_run:  # the same code on the CPU is tests/bench/test_profile.py's: the dry run checks the call
        return {"skipped": "the dry run (tests/bench/test_profile.py profiles the CPU)", "main": profile_main.__name__}
    out = run.out.parent / "profile.json"
    grid = ["--image-sizes", "224,448,896", "--encoder-batches", "1,4,16", "--prefill-lengths", "512,2048,8192",
            "--decode-batches", "1,16,64,256", "--contexts", "512,4096", "--transfer-mb", "1,16,256",
            "--idle-gaps", "0.1,1"]  # a dedicated GPU host should show little wake-up cost: two points
    code = profile_main(["--model", "tiny-qwen2-vl", "--device", run.device, "--out", str(out), *grid])
    profile_json = json.loads(out.read_text()) if code == 0 else {}
    return {"exit_code": code, "file": str(out), "profile": profile_json}


PHASES = {"env": env, "fidelity": fidelity, "ipc": ipc, "encoder": encoder, "decode": decode, "overlap": overlap,
          "tensor_parallel": tensor_parallel, "profile": profile}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    parser.add_argument("--dry-run", action="store_true", help="CPU and tiny shapes: check the script")
    parser.add_argument("--deadline-s", type=float, default=450.0)
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s) {sorted(unknown)}; expected some of {list(PHASES)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --dry-run to check the script on the CPU")
    run = Run(args.out, args.dry_run, args.deadline_s)
    try:  # EPD and transformers, once: a version mismatch among the carried wheels is one clear line
        import epd.llm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - recorded, then the run ends
        run.results["import_error"] = f"{type(err).__name__}: {err}"
        run.results["trace"] = traceback.format_exc()[-3000:]
        args.out.write_text(json.dumps(run.results, indent=2))
        print(f"gpu_bench: importing EPD failed: {run.results['import_error']}", flush=True)
        return 1
    try:
        for name in args.only.split(","):
            run.phase(name, PHASES[name])
    finally:
        run.close()
    return 1 if failed_phases(run.results) else 0


def failed_phases(results: dict) -> list[str]:
    """The phases that ran and failed (a skipped one, past the deadline, is not a failure)."""
    return [name for name, result in results["phases"].items() if result.get("ok") is False]


if __name__ == "__main__":
    sys.exit(main())
