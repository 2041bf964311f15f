"""Shared fixtures: a private EPD cache dir for the whole session, and synthetic images."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

# Every Ray cluster the suite starts is its own, on loopback. Ray fixes a process's auth mode at
# its first init: a test process that met a token-auth cluster rejects the calls of a later
# cluster without tokens (its GCS then ends the new actors as unowned), so one mode for the run.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    # presets and the built tokenizer are cached here, never in the user's home; pytest-xdist's
    # workers share one (their temp dirs sit side by side; presets are written atomically, so two
    # workers building one preset at once end with one complete copy)
    shared = tmp_path_factory.getbasetemp().parent / "epd-cache" if os.environ.get("PYTEST_XDIST_WORKER") else None
    if shared is not None:
        shared.mkdir(exist_ok=True)
    path = os.environ.get("EPD_CACHE_DIR_FOR_TESTS") or str(shared or tmp_path_factory.mktemp("epd-cache"))
    old = os.environ.get("EPD_CACHE_DIR")
    os.environ["EPD_CACHE_DIR"] = path
    yield path
    if old is None:
        os.environ.pop("EPD_CACHE_DIR", None)
    else:
        os.environ["EPD_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def _float32_means_float32_on_cuda():
    """CUDA tests compare float32 results with the CPU's: cuDNN's default TF32 convolutions (the
    vision tower's patch embedding) would differ by ~1e-3 and could flip a greedy token. Set for
    the whole session, before any module fixture captures a CUDA graph."""
    import torch
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def make_image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A noise image (noise, so every patch differs and the vision tower sees real content)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def make_video_bytes(num_frames: int = 12, fps: int = 4, width: int = 96, height: int = 64, seed: int = 0,
                     frames: list[np.ndarray] | None = None) -> bytes:
    """A lossless video (epd bench's ``render_video``): a bright square moving over noise, or the
    ``frames`` given ([H, W, 3] uint8)."""
    from epd.bench.workload import render_video

    return render_video(num_frames, fps, width, height, seed=seed, frames=frames)


@pytest.fixture(scope="session", autouse=True)
def _no_shared_memory_left_behind():
    """Whole suite: every segment a test (or a worker it started) made is gone at the end."""
    from epd.shm_owners import SHM_DIR, is_stale, own_names

    before = own_names()
    yield
    # only EPD names of this user; a segment whose producer still lives in another process belongs
    # to someone else running on this machine (another test session, a server), not to a worker
    # this session started and stopped
    leaked = sorted(name for name in own_names() - before
                    if is_stale(name) or name.startswith(f"epd_{os.getpid()}_"))
    for name in leaked:  # clean up even when failing, so the next run starts clean
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
    assert not leaked, f"the test session left shared-memory segments in /dev/shm: {leaked}"


# Seconds each slow module took in a whole run on the 2-core CI box (`--durations=0`, summed per
# file; refresh now and then). Only the order of work uses them: under pytest-xdist each worker
# takes the next whole module, and starting with the longest keeps one worker from finishing a
# long module alone at the end (longest-processing-time-first). A module not listed goes last.
_MODULE_SECONDS_FILE = os.path.join(os.path.dirname(__file__), "module_seconds.txt")


def _module_seconds() -> dict[str, float]:
    seconds = {}
    with open(_MODULE_SECONDS_FILE) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                value, path = line.split()
                seconds[path] = float(value)
    return seconds


# Modules one xdist worker runs one after the other, never beside each other: each starts its own
# Ray cluster (4 raylets in the multinode one), and two at once on 2 cores overran Ray's fixed 30 s
# wait for a raylet to register (CI).
_SERIAL_GROUPS = {"tests/deploy/test_ray.py": "ray", "tests/deploy/test_ray_multinode.py": "ray",
                  "tests/deploy/test_ray_sizing.py": "ray"}


def _scope(module: str) -> str:
    return _SERIAL_GROUPS.get(module, module)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    seconds = _module_seconds()
    by_scope: dict[str, float] = {}
    for module, value in seconds.items():
        by_scope[_scope(module)] = by_scope.get(_scope(module), 0.0) + value
    # stable: a module's own order stays; a serial group's modules stay together, weighed as one
    items.sort(key=lambda item: (-by_scope.get(_scope(item.nodeid.split("::", 1)[0]), 0.0),
                                 _scope(item.nodeid.split("::", 1)[0])))


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: whole modules per worker as usual, a serial group as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedModules(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(super()._split_scope(nodeid))

    return GroupedModules(config, log)
