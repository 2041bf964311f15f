"""A standby process: ``python -m epd.server.standby <tier>`` imports what the tier (or the
router) needs (torch, transformers' model code, the tier's servicer; the router's app), says so,
and waits for one line on stdin, the JSON argument list of ``epd <tier> ...``; then it becomes that
process. EOF on stdin: it exits.

Why: a worker that dies is replaced by a fresh process, and on a small, busy host most of a cold
start is imports (torch alone is ~3 s idle here, several times that under load). The local
supervisor keeps one standby per tier, so a restart costs only the model load and the listener.
The router needs the workers' addresses, known only once they listen: ``epd serve`` starts it as a
standby beside them, so its imports (~3 s of CPU) overlap theirs instead of following them.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import threading

from epd.server.parent import watch_parent

STANDBY_READY = "EPD_STANDBY ready"
_TIERS = ("encoder", "prefill", "decode", "router")
# imported ahead; a module a build lacks is skipped (the process imports what it needs itself)
_PRELOAD = ("torch", "epd.server.tier", "epd.models.registry", "epd.models.presets")
# the vision towers are transformers' (~2.5 s of CPU to import); the LLM tiers run our own model code
_ENCODER_PRELOAD = ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
_ROUTER_PRELOAD = ("epd.server.router", "epd.router.openai.app", "epd.router.grpc_api",
                   "epd.router.backends.disaggregated", "epd.models.presets")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in _TIERS or len(argv) > (2 if argv[0] == "router" else 1):
        print(f"usage: python -m epd.server.standby {{{','.join(_TIERS)}}} (router [MODEL]), got {argv}",
              file=sys.stderr)
        return 2
    tier = argv[0]
    # it holds nothing yet: with its launcher gone it just goes too (once a worker, the worker's own
    # watch stops it cleanly instead)
    became_worker = threading.Event()
    watch_parent(lambda: None if became_worker.is_set() else os._exit(0))
    preload = _ROUTER_PRELOAD if tier == "router" else \
        (*_PRELOAD, *(_ENCODER_PRELOAD if tier == "encoder" else ()), f"epd.{tier}.servicer")
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if tier == "router" and len(argv) == 2:
        _load_tokenizer(argv[1])
    print(STANDBY_READY, flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0  # the supervisor let go of us: nothing to become
    try:
        args = json.loads(line)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, list) or not args or args[0] != tier or not all(isinstance(a, str) for a in args):
        print(f"epd standby {tier}: expected a JSON list of strings starting with {tier!r}, got {line[:200]!r}",
              file=sys.stderr)
        return 2
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # as a cold-started worker's: it never reads stdin
    became_worker.set()
    if tier == "router":
        from epd.server.router import main as router_main
        return router_main(args[1:]) or 0
    from epd.server.tier import main as tier_main  # the tier's own entry, not the whole CLI above it
    return tier_main(tier, args[1:]) or 0


def _load_tokenizer(model: str) -> None:
    """The router's tokenizer loaded ahead (~1.5 s of CPU for a Qwen one), into the process's cache
    that the router reads (``epd.models.tokenizer_loading``). Only a checkpoint already here (a
    directory, a preset, the hub cache: nothing is downloaded); any failure is the router's to report."""
    from epd.models.locate import resolve_model
    from epd.models.tokenizer_loading import load_tokenizer

    try:
        load_tokenizer(resolve_model(model))
    except Exception:  # noqa: BLE001 - the router meets the same problem and says it properly
        pass


if __name__ == "__main__":
    try:
        code = main()
    finally:
        from epd.server.process import freeze_for_exit
        freeze_for_exit()
    sys.exit(code)
