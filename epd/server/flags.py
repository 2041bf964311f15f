"""The one definition of every process's command-line flags: a flag is a config field
(``epd/config/``), named after it (``max_num_batched_tokens`` -> ``--max-num-batched-tokens``),
described by its description, parsed by the config's own validation. A command lists the config
classes it takes; a name that appears in several (``--model``, ``--max-model-len``) is one flag
that sets all of them, so no two commands can drift apart.

Precedence: a field's default < the ``--config`` YAML < a flag given on the command line.
"""
from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import dataclass, field

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from epd.config import ConfigError, deep_merge, load_config, load_yaml

Path = tuple[str, ...]


@dataclass
class _Flag:
    dest: str
    paths: list[Path] = field(default_factory=list)
    action: argparse.Action | None = None
    defaults: dict[Path, object] = field(default_factory=dict)  # config path -> the field's default there
    description: str | None = None  # the first config's (the help keeps one)
    repeatable: bool = False


@dataclass
class Command:
    """The flags of one command, built from config classes, and what they set."""

    parser: argparse.ArgumentParser
    flags: dict[str, _Flag] = field(default_factory=dict)

    def add(self, cls: type[BaseModel], at: Path = (), *, skip: tuple[str, ...] = ()) -> "Command":
        """Flags for ``cls``'s fields (nested configs flattened into the same names), whose values
        go to ``at + field path`` of the command's config data."""
        for name, info in cls.model_fields.items():
            if name in skip:
                continue
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                self.add(annotation, (*at, name), skip=skip)
                continue
            if not _flaggable(annotation):
                continue  # structured values (e.g. CUDA graph buckets) come from the YAML only
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            self._flag(extra.get("flag", name), (*at, name), annotation, info, tuple(extra.get("aliases", ())))
        return self

    def _flag(self, name: str, path: Path, annotation, info, aliases: tuple[str, ...] = ()) -> None:
        if name in self.flags:  # the same setting in several configs: one flag sets them all
            flag = self.flags[name]
            flag.paths.append(path)
            flag.defaults[path] = info.default
            flag.action.help = _help(flag.description, flag.defaults, repeatable=flag.repeatable)
            return
        option, dest = "--" + name.replace("_", "-"), f"flag_{name}"
        defaults = {path: info.default}
        repeatable = typing.get_origin(_base(annotation)) is tuple
        if _is_bool(annotation):
            action = self.parser.add_argument(option, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                              help=_help(info.description, defaults))
        elif repeatable:  # and each may be a comma list
            action = self.parser.add_argument(option, dest=dest, default=None, action="append",
                                              metavar=_metavar(annotation),
                                              help=_help(info.description, defaults, repeatable=True))
        else:  # aliases: vLLM's short forms (-tp)
            action = self.parser.add_argument(*aliases, option, dest=dest, default=None, metavar=_metavar(annotation),
                                              help=_help(info.description, defaults))
        self.flags[name] = _Flag(dest, [path], action, defaults, info.description, repeatable)

    def parse_args(self, argv: list[str] | None) -> argparse.Namespace:
        """The command line parsed, vLLM's flags translated first (``epd.server.vllm_flags``: taken
        out with a line saying why, or refused in one line)."""
        from epd.server.vllm_flags import translate

        argv = sys.argv[1:] if argv is None else list(argv)
        return self.parser.parse_args(translate(argv, self.parser._option_string_actions, self.parser.prog))

    def overrides(self, args: argparse.Namespace) -> dict:
        """The values given on the command line, as nested config data."""
        out: dict = {}
        for flag in self.flags.values():
            value = getattr(args, flag.dest)
            if value is None:
                continue
            if isinstance(value, list):  # a repeated flag: one comma list
                value = ",".join(value)
            for path in flag.paths:
                node = out
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = value
        return out


def load(cls: type[BaseModel], command: Command, args: argparse.Namespace, *, yaml_path: str | None,
         yaml_at: Path = (), prog: str) -> BaseModel:
    """``cls`` from defaults, then the YAML file (placed at ``yaml_at``), then the flags."""
    data: dict = {}
    if yaml_path:
        loaded = load_yaml(yaml_path)
        for key in reversed(yaml_at):
            loaded = {key: loaded}
        data = loaded
    data = deep_merge(data, command.overrides(args))
    return load_config(cls, data, source=yaml_path or "command line")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (what was wrong), not the usage of every flag."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def run_or_exit(prog: str, build):
    """``build()``, or one line on stderr and exit code 2 (argparse's) when the configuration is wrong."""
    try:
        return build()
    except ConfigError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _base(annotation):
    """``X`` of ``X | None`` and of ``Annotated[X, ...]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _base(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return _base(typing.get_args(annotation)[0])
    return annotation


def _flaggable(annotation) -> bool:
    base = _base(annotation)
    if typing.get_origin(base) is tuple:
        return typing.get_args(base) == (str, Ellipsis)  # tuple[str, ...]: comma-separated
    # dict[str, int]: one text value (JSON or k=v pairs) the config's own validator parses
    return base in (str, int, float, bool) or typing.get_origin(base) in (typing.Literal, dict)


def _is_bool(annotation) -> bool:
    return _base(annotation) is bool


def _metavar(annotation) -> str:
    base = _base(annotation)
    if typing.get_origin(base) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(base))) + "}"
    if typing.get_origin(base) is tuple:
        return "A,B,..."
    if typing.get_origin(base) is dict:
        return "JSON|K=V,..."
    return {int: "N", float: "X", str: "TEXT"}.get(base, "VALUE")


def _help(description: str | None, defaults: dict[Path, object], *, repeatable: bool = False) -> str:
    """A flag's help: its description and its default; a flag that sets several configs whose
    defaults differ names each (``--request-timeout-s``: the router's 300 s, each worker's 120 s).
    No default is shown for a field without one, or whose default is empty."""
    values = {path: None if _is_empty(value) else value for path, value in defaults.items()}
    text = description or ""
    if len({repr(v) for v in values.values()}) > 1:
        text += " (default: " + ", ".join(f"{'none' if value is None else value} for "
                                          f"{'.'.join(path[:-1]) or 'the command'}"
                                          for path, value in values.items()) + ")"
    elif (value := next(iter(values.values()))) is not None:
        text += f" (default: {value})"
    return text + (" (repeatable)" if repeatable else "")


def _is_empty(default) -> bool:
    """No default to show: none, an empty one, or a field that has none (or makes it per instance)."""
    return default is None or default is PydanticUndefined or (isinstance(default, (tuple, str)) and not default)
