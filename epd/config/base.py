"""What every config is made of: a frozen model that refuses unknown keys and booleans
posing as integers, the field types (dtypes, devices, ports), where ``auto`` devices and dtypes
resolve, and loading (YAML, validation, one-line errors).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

MiB = 1024 * 1024
C = TypeVar("C", bound=BaseModel)

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_device(value: str) -> str:
    if not _DEVICE_PATTERN.fullmatch(value):
        raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return value


def resolve_device(device: str) -> str:
    """``auto``: this process's CUDA device when it has one, else the CPU. Resolved where the
    model runs (a launcher without a GPU must not decide for a worker with one)."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA, float32 on the CPU (where bf16 matmuls are slow)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolve_device(device).startswith("cuda") else "float32"


def readable_file(value: str | None, what: str) -> str | None:
    """A path a config names must be a file there now (a typo fails at start, not at first use)."""
    if value is not None and not Path(value).is_file():
        raise ValueError(f"expected a readable {what}, got {value!r} (no such file)")
    return value


def cuda_indices(value: Any, example: str) -> Any:
    """CUDA device indices, comma-separated or a list, as a tuple of digit strings (the flags' form)."""
    indices = [a.strip() for a in value.split(",") if a.strip()] if isinstance(value, str) else value
    for index in indices or ():
        if not str(index).isdigit():
            raise ValueError(f"expected CUDA device indices like {example}, got {value!r}")
    return tuple(str(i) for i in indices or ())


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):  # YAML's yes/no must not pass as 1/0
        raise ValueError(f"expected an integer, got {value!r}")
    return value


# vLLM's spellings too (--dtype half / float), as the names torch gives them
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
Dtype = Annotated[Literal["auto", "float32", "bfloat16", "float16"],
                  BeforeValidator(lambda value: _DTYPE_ALIASES.get(value, value))]
Device = Annotated[str, AfterValidator(_check_device)]
PositiveInt = Annotated[int, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
# a model's placement, the same field on every config that loads one (engine, encoder)
ModelDtype = Annotated[Dtype, Field(description="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")]
ModelDevice = Annotated[Device, Field(description="auto (CUDA when this process has it, else CPU), cpu, cuda or "
                                                  "cuda:N")]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming key, expected and value."""


class FrozenConfig(BaseModel):
    """Every config's base: frozen (shared between threads as it is), and a key it does not know is
    an error, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _integers_are_not_booleans(cls, value: Any, info) -> Any:
        annotation = str(cls.model_fields[info.field_name].annotation)
        return _no_bool(value) if "int" in annotation and "bool" not in annotation else value


def torch_dtype_named(name: str):
    import torch  # keep configs importable without paying for torch
    return getattr(torch, name)


class OnDevice:
    """For a config with ``device`` and ``dtype`` fields: what their ``auto`` resolves to, asked
    where the model runs (a launcher without a GPU must not decide for a worker with one)."""

    @property
    def target_device(self) -> str:
        return resolve_device(self.device)

    @property
    def torch_dtype(self):
        return torch_dtype_named(resolve_dtype(self.dtype, self.device))


def parse_mapping(value: Any) -> Any:
    """A mapping given on the command line: JSON (``{"image": 4}``, vLLM's form) or ``k=v,k=v``."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as err:
            raise ValueError(f"expected a JSON object or key=value pairs, got {value!r}: {err}") from None
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, number = pair.partition("=")
        try:
            out[key.strip()] = json.loads(number.strip()) if sep else None
        except ValueError:
            out[key.strip()] = None
        if not isinstance(out[key.strip()], (int, float)) or isinstance(out[key.strip()], bool):
            raise ValueError(f"expected a JSON object or key=value pairs of numbers, got {value!r}")
    return out


# ---- loading ---------------------------------------------------------------------------------------
def load_config(cls: type[C], data: dict[str, Any] | None = None, *, source: str = "config") -> C:
    """Validate ``data`` as ``cls``; any problem is a one-line ``ConfigError`` naming the key."""
    try:
        return cls.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(describe(err, source)) from None


def from_dict(cls: type[C], data: dict[str, Any] | None) -> C:
    return load_config(cls, data, source=cls.__name__)


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def describe(err: ValidationError, source: str) -> str:
    """The first problem as ``source: key: what was expected, got value`` (+ how many more)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:  # a rule across fields: the message names them and their values
        return f"{source}: {message}{more}"
    key = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key {key!r}{more}"
    got = "" if first["type"] == "missing" or "got " in message else f", got {first['input']!r}"
    return f"{source}: {key}: {message}{got}{more}"


def deep_merge(base: dict, overrides: dict) -> dict:
    """``overrides`` on top of ``base``, nested mappings merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
