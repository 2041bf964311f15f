"""Requests from a local JSONL file for ``epd bench --dataset-name jsonl --dataset-path FILE``.

One request per line, a JSON object::

    {"prompt": "What is in this picture?", "images": ["cat.png", "https://example.com/dog.jpg"], "output_len": 64}

- ``prompt`` (required): the user text; the images go before it, in order.
- ``images`` (optional): each a local path (relative to the file's folder), a ``file://`` URL, a
  ``data:`` URL or an ``http(s)://`` URL. Local files are read once, here, and sent as bytes; URLs
  are sent as they are and the server fetches them (its media rules apply).
- ``output_len`` (optional; ``output_tokens`` and ``max_tokens`` are read as the same): output
  tokens to ask for, EOS ignored; default ``--output-len``.

The same from the files other benchmarks read (``--dataset-name sharegpt`` / ``vision-arena``;
local files only, JSON Lines or one JSON array):

- ShareGPT (LLaVA's multimodal form too): ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...], "image": "a.png"}`` (or ``"images": [...]``): the first human
  turn is the prompt (LLaVA's ``<image>`` markers taken out: the images go first), the first reply
  sets the output length (its words x 4/3, a token estimate: the bench has no tokenizer).
- VisionArena: ``{"conversation": [{"role": "user", "content": ...}, ...], "images": [...]}`` (a
  conversation may be nested one list deeper, as the dataset ships it; an image entry may be a path
  or ``{"path": ...}``): the first user turn is the prompt; the output length is ``--output-len``.

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
    return _load(path, lambda row, where: _epd_row(row, default_output_len, where))


def load_sharegpt(path: str | Path, *, default_output_len: int) -> list[RequestSpec]:
    """ShareGPT-style conversations (JSON Lines or one JSON array) as requests."""
    return _load(path, lambda row, where: _sharegpt_row(row, default_output_len, where))


def load_vision_arena(path: str | Path, *, default_output_len: int) -> list[RequestSpec]:
    """VisionArena-style conversations (JSON Lines or one JSON array) as requests."""
    return _load(path, lambda row, where: _vision_arena_row(row, default_output_len, where))


LOADERS = {"jsonl": load_jsonl, "sharegpt": load_sharegpt, "vision-arena": load_vision_arena}


def _load(path: str | Path, read_row) -> list[RequestSpec]:
    """``read_row(row, where)`` -> (prompt, image entries, output_len) for each row of ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read the dataset {path}: {err.strerror or err}") from None
    files: dict[Path, bytes] = {}  # each local image read once, however often the dataset names it
    seen: set[object] = set()
    requests = []
    for where, row in _rows(text, path):
        prompt, entries, output_len = read_row(row, where)
        inputs = [_image(entry, path.parent, files, f"{where}: images[{k}]") for k, entry in enumerate(entries)]
        keys = [x if isinstance(x, str) else id(x) for x in inputs]
        repeated = sum(1 for key in keys if key in seen)
        seen.update(keys)
        requests.append(RequestSpec(index=len(requests), prompt=prompt, images=[], output_len=output_len,
                                    arrival_s=0.0, image_inputs=inputs, repeated_inputs=repeated))
    if not requests:
        raise ValueError(f"the dataset {path} has no requests (one JSON object per line)")
    return requests


def _rows(text: str, path: Path):
    """(where, row) of a JSON Lines file, or of a file that is one JSON array (ShareGPT's own;
    not a ``.jsonl`` file, whose first line may well be an array: an error there)."""
    if path.suffix != ".jsonl" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{path}: not JSON ({err})") from None
        for number, row in enumerate(rows):
            yield f"{path}[{number}]", _object(row, f"{path}[{number}]")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{where}: not JSON ({err})") from None
            yield where, _object(row, where)


def _object(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
    return row


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


def _epd_row(row: dict, default_output_len: int, where: str) -> tuple[str, list, int]:
    unknown = sorted(set(row) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected {sorted(_KNOWN_KEYS)}")
    if not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {row.get('prompt')!r}")
    return row["prompt"], _image_list(row.get("images", []), where), _output_len(row, default_output_len, where)


def _sharegpt_row(row: dict, default_output_len: int, where: str) -> tuple[str, list, int]:
    turns = row.get("conversations")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError(f"{where}: expected 'conversations': [{{\"from\": \"human\", \"value\": ...}}, ...]")
    asked = [t.get("value") for t in turns if t.get("from") in ("human", "user")]
    answered = [t.get("value") for t in turns if t.get("from") in ("gpt", "assistant", "chatgpt")]
    if not asked or not isinstance(asked[0], str) or not asked[0].replace("<image>", "").strip():
        raise ValueError(f"{where}: no human turn with text in 'conversations'")
    images = row.get("images", [row["image"]] if isinstance(row.get("image"), str) else [])
    reply = answered[0] if answered and isinstance(answered[0], str) else ""
    output_len = max(1, round(len(reply.split()) * 4 / 3)) if reply else default_output_len
    return asked[0].replace("<image>", "").strip(), _image_list(images, where), output_len


def _vision_arena_row(row: dict, default_output_len: int, where: str) -> tuple[str, list, int]:
    turns = row.get("conversation")
    if isinstance(turns, list) and turns and isinstance(turns[0], list):
        turns = turns[0]  # as the dataset ships it: a list of conversations, the first one asked
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise ValueError(f"{where}: expected 'conversation': [{{\"role\": \"user\", \"content\": ...}}, ...]")
    asked = [t.get("content") for t in turns if t.get("role") == "user"]
    if not asked or not isinstance(asked[0], str) or not asked[0].strip():
        raise ValueError(f"{where}: no user turn with text in 'conversation'")
    images = [entry.get("path") if isinstance(entry, dict) else entry for entry in row.get("images") or []]
    return asked[0], _image_list(images, where), default_output_len


def _image_list(images, where: str) -> list:
    if not isinstance(images, list):
        raise ValueError(f"{where}: 'images' must be a list of paths or URLs, got {images!r}")
    return images


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
