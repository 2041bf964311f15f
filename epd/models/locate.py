"""Where a model is: ``--model`` as a user gives it (a checkpoint directory, a preset name, the
zero-cost model, or a Hugging Face hub id already in the local cache) -> its checkpoint directory.
Nothing is downloaded at run time; a model that is nowhere says which command fetches it."""
from __future__ import annotations

from pathlib import Path

from epd.models.presets import PRESETS, preset_checkpoint


def resolve_model(path_or_preset: str | Path, *, revision: str | None = None, download_dir: str | None = None,
                  download: bool = False) -> Path:
    """A checkpoint directory as is, or a preset name -> its cached checkpoint (written once), or a
    hub id -> its snapshot (``revision``: a branch, tag or commit; default main) in the hub cache
    (``download_dir``: another cache folder), fetched first when ``download`` and not there yet."""
    text = str(path_or_preset)
    from epd.models.null.checkpoint import NULL_PRESETS, resolve_null_preset
    if text in NULL_PRESETS:  # the zero-cost model: no weights, nothing computed
        return resolve_null_preset(text)
    if text in PRESETS:
        return preset_checkpoint(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json; expected a Hugging Face checkpoint")
        return path
    if path.exists():
        raise ValueError(f"model path {path} is a file; expected a checkpoint directory or a preset name")
    if looks_like_a_hub_id(text):
        return _from_hub(text, revision, download_dir, download)
    raise ValueError(f"model {text!r} is neither a directory nor a preset; presets: "
                     f"{', '.join([*PRESETS, *NULL_PRESETS])}")


def looks_like_a_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and not text.startswith(("~", "/"))


def _from_hub(repo_id: str, revision: str | None, download_dir: str | None, download: bool) -> Path:
    """A Hugging Face hub id from the cache; with ``download``, fetched from the hub when it is not
    there (huggingface_hub's progress bars on stderr; where the network allows)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    cache = download_dir or HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except Exception as err:  # noqa: BLE001 - LocalEntryNotFoundError, bad names, ... : one clear message
        missing = err
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "") + \
        (f" --cache-dir {download_dir}" if download_dir else "")
    if download:
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache))
        except Exception as err:  # noqa: BLE001 - offline, no such repo, gated: one clear message
            raise ValueError(f"model {repo_id!r}{f' at {revision}' if revision else ''} is not in the Hugging Face "
                             f"cache ({cache}) and could not be downloaded ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200]}); fetch it where the network allows ({fetch}) "
                             "or give its directory") from None
    raise ValueError(f"model {repo_id!r} is not a directory, a preset, or in the local Hugging Face cache "
                     f"({cache}); download it first ({fetch}) or give its directory "
                     f"({type(missing).__name__})") from None
