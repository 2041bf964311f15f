"""Requests from a local JSONL file for ``epd bench --dataset-name jsonl --dataset-path FILE``.

One request per line, a JSON object::

    {"prompt": "What is in this picture?", "images": ["cat.png", "https://example.com/dog.jpg"], "output_len": 64}

- ``prompt`` (required): the user text; the images go before it, in order.
- ``images`` (optional): each a local path (relative to the file's folder), a ``file://`` URL, a
  ``data:`` URL or an ``http(s)://`` URL. Local files are read once, here, and sent as bytes; URLs
  are sent as they are and the server fetches them (its media rules apply).
- ``output_len`` (optional; ``output_tokens`` and ``max_tokens`` are read as the same): output
  tokens to ask for, EOS ignored; default ``--output-len``.

A line that is not such an object, or an image file that cannot be read, stops the bench before
any request is sent, with the file, the line and what was expected."""
from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote, urlparse

from epd.bench.workload import RequestSpec

_URL_PREFIXES = ("http://", "https://", "data:")
_OUTPUT_KEYS = ("output_len", "output_tokens", "max_tokens")
_KNOWN_KEYS = {"prompt", "images", *_OUTPUT_KEYS}


def load_jsonl(path: str | Path, *, default_output_len: int) -> list[RequestSpec]:
    """Every line of ``path`` as a request (arrival times are set per run, see ``with_arrivals``)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"cannot read the dataset {path}: {err.strerror or err}") from None
    files: dict[Path, bytes] = {}  # each local image read once, however often the dataset names it
    seen: set[object] = set()
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        row = _row(line, where)
        inputs = [_image(entry, path.parent, files, f"{where}: images[{k}]")
                  for k, entry in enumerate(row.get("images") or [])]
        keys = [x if isinstance(x, str) else id(x) for x in inputs]
        repeated = sum(1 for key in keys if key in seen)
        seen.update(keys)
        requests.append(RequestSpec(index=len(requests), prompt=row["prompt"], images=[],
                                    output_len=_output_len(row, default_output_len, where), arrival_s=0.0,
                                    image_inputs=inputs, repeated_inputs=repeated))
    if not requests:
        raise ValueError(f"the dataset {path} has no requests (one JSON object per line)")
    return requests


def take(requests: list[RequestSpec], num_prompts: int | None) -> list[RequestSpec]:
    """The first ``num_prompts`` requests, going round the dataset again when it is shorter (its
    images then repeat: the encoder cache sees them again); None: all of them once."""
    if num_prompts is None:
        return list(requests)
    out = []
    for i in range(num_prompts):
        base = requests[i % len(requests)]
        again = i >= len(requests)
        out.append(RequestSpec(index=i, prompt=base.prompt, images=[], output_len=base.output_len, arrival_s=0.0,
                               image_inputs=base.image_inputs,
                               repeated_inputs=len(base.image_inputs) if again else base.repeated_inputs))
    return out


def with_arrivals(requests: list[RequestSpec], arrivals) -> list[RequestSpec]:
    for spec, at in zip(requests, arrivals):
        spec.arrival_s = float(at)
    return requests


def _row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object like {{\"prompt\": ..., \"images\": [...]}}, got "
                         f"{type(row).__name__}")
    unknown = sorted(set(row) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected {sorted(_KNOWN_KEYS)}")
    if not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {row.get('prompt')!r}")
    if not isinstance(row.get("images", []), list):
        raise ValueError(f"{where}: 'images' must be a list of paths or URLs, got {row['images']!r}")
    return row


def _output_len(row: dict, default: int, where: str) -> int:
    given = [k for k in _OUTPUT_KEYS if k in row]
    if len(given) > 1:
        raise ValueError(f"{where}: give one of {list(_OUTPUT_KEYS)}, not {given}")
    value = row[given[0]] if given else default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {given[0] if given else 'output_len'} must be an integer >= 1, got {value!r}")
    return value


def _image(entry, folder: Path, files: dict[Path, bytes], where: str) -> bytes | str:
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"{where}: expected a path or URL string, got {entry!r}")
    if entry.startswith(_URL_PREFIXES):
        return entry
    if entry.startswith("file:"):
        entry = unquote(urlparse(entry).path)
    file = (folder / entry).expanduser().resolve()
    if file not in files:
        try:
            files[file] = file.read_bytes()
        except OSError as err:
            raise ValueError(f"{where}: cannot read {file}: {err.strerror or err}") from None
    return files[file]
