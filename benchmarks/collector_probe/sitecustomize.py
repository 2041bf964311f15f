"""The garbage collector's CPU in a process, for ``benchmarks/control_plane.py --collector``: with
this folder on PYTHONPATH every Python process started counts each collection's CPU time (its own
thread's) by generation, and writes its totals to ``$EPD_BENCH_COLLECTOR_DIR/<pid>.json`` twice a
second. Nothing else changes in the process. A benchmark tool only: never on a server's path."""
import gc
import json
import os
import threading
import time

_DIR = os.environ.get("EPD_BENCH_COLLECTOR_DIR")
_totals = {"collections": [0, 0, 0], "cpu_s": [0.0, 0.0, 0.0]}
_started = [0.0]


def _count(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.thread_time()
        return
    generation = info["generation"]
    _totals["collections"][generation] += 1
    _totals["cpu_s"][generation] += time.thread_time() - _started[0]


def _write_forever() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    while True:
        time.sleep(0.5)
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(_totals, f)
            os.replace(path + ".tmp", path)
        except OSError:
            return


def _start() -> None:
    threading.Thread(target=_write_forever, name="collector-probe", daemon=True).start()


if _DIR:
    gc.callbacks.append(_count)
    _start()
    os.register_at_fork(after_in_child=lambda: (_totals.update(collections=[0, 0, 0], cpu_s=[0.0, 0.0, 0.0]),
                                                 _start()))
