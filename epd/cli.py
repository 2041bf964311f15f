"""``epd`` command line: thin wrappers over the library."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    from epd.config import ConfigError, EngineConfig, load_config
    from epd.llm import LLM
    from epd.types import SamplingParams

    try:
        engine_config = load_config(EngineConfig, args.engine_flags.overrides(args), source="command line")
    except ConfigError as err:
        raise ValueError(str(err)) from None
    content = [{"type": kind, kind: str(Path(p).resolve())} for kind, p in args.media]
    content.append({"type": "text", "text": args.prompt})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    kwargs = json.loads(args.mm_processor_kwargs) if args.mm_processor_kwargs else None
    with LLM(args.model, engine_config=engine_config) as llm:
        out = llm.chat([{"role": "user", "content": content}], params, mm_processor_kwargs=kwargs)[0]
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                          "text": out.text, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def _export_preset(args: argparse.Namespace) -> int:
    from epd.models.null.checkpoint import NULL_PRESETS, write_null_checkpoint
    from epd.models.presets import write_preset_checkpoint

    if args.name in NULL_PRESETS:  # the zero-cost model: no weights, so no seed
        if args.seed is not None:
            raise ValueError(f"{args.name} has no weights: --seed does not apply to it")
        path = write_null_checkpoint(Path(args.out_dir), NULL_PRESETS[args.name])
    else:
        path = write_preset_checkpoint(args.name, Path(args.out_dir), seed=args.seed)
    print(path)
    return 0


class _Media(argparse.Action):
    """--image and --video append (kind, path) to one list, keeping their order on the command line."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        items = list(getattr(namespace, self.dest) or [])  # a copy: the default list is the parser's
        items.append((option_string.removeprefix("--"), value))
        setattr(namespace, self.dest, items)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description="Encode/Prefill/Decode serving for VLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one-shot offline generation on the in-process engine")
    gen.add_argument("--model", default="tiny-qwen2-vl", help="preset name or HF checkpoint directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--image", dest="media", action=_Media, default=[], help="image path (repeatable; images and "
                     "videos go before the prompt in the order given)")
    gen.add_argument("--video", dest="media", action=_Media, default=[], help="video path (repeatable)")
    gen.add_argument("--mm-processor-kwargs", default=None,
                     help='JSON: min_pixels / max_pixels, and fps / min_frames / max_frames for videos')
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print prompt_token_ids, token_ids and text as JSON")
    from epd.config import EngineConfig
    from epd.server.flags import Command
    # the engine's own flags (--device, --dtype, --num-threads, ...), as every other command has them
    gen.set_defaults(func=_generate, engine_flags=Command(gen).add(EngineConfig))

    exp = sub.add_parser("export-preset", help="write a preset model as a HF checkpoint directory")
    exp.add_argument("name")
    exp.add_argument("out_dir")
    exp.add_argument("--seed", type=int, default=None, help="weight seed (default: the preset's own)")
    exp.set_defaults(func=_export_preset)

    for name, help_text in _PROCESS_HELP.items():  # listed for --help; dispatched in main() before parsing
        sub.add_parser(name, help=f"{help_text} (see: epd {name} --help)", add_help=False)
    return parser


_PROCESS_MAINS = {"router": "epd.server.router", "serve": "epd.server.serve", "bench": "epd.bench.cli",
                  "profile": "epd.bench.profile", "plan": "epd.plan.planner"}
_TIERS = ("encoder", "prefill", "decode")
_PROCESS_HELP = {"serve": "the embedded default: router + encoder + prefill + decode processes on loopback",
                 "router": "run the router (OpenAI HTTP + public gRPC) over running workers",
                 "encoder": "run one encoder worker", "prefill": "run one prefill worker",
                 "decode": "run one decode worker",
                 "bench": "load generator against a running server: latency percentiles, goodput, plots",
                 "profile": "what each stage costs here for one model (encoder, prefill, decode, transfer) as JSON",
                 "plan": "rank E:P:D splits of a device budget by simulated goodput for a profile, workload and SLO"}


def main(argv: list[str] | None = None) -> int:
    """``argv``: None as the program (then the process exits after it: ``freeze_for_exit``); a list
    from a caller that goes on (a test), whose objects stay the collector's."""
    as_program = argv is None
    if as_program:
        from epd import heap
        heap.own()
    try:
        return _run(argv)
    finally:
        if as_program:
            from epd import heap
            heap.freeze_for_exit()


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _TIERS:
        # one tier process (flags from epd/server/flags.py), started by launchers, Kubernetes, Ray
        from epd.server.tier import main as tier_main
        return tier_main(argv[0], argv[1:]) or 0
    if argv and argv[0] in _PROCESS_MAINS:
        import importlib
        return importlib.import_module(_PROCESS_MAINS[argv[0]]).main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"epd {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
