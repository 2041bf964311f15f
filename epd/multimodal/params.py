"""Per-request multimodal payload: the ``multimodal_data`` dict and what may go on a device.

``multimodal_data`` layout (every key optional)::

    {
        "mrope_config": {"mrope_rotary_cos_sin": Tensor, "mrope_position_deltas": Tensor},
        "multimodal_embedding": Tensor | list[Tensor],   # [rows, hidden] once encoded
        "image": {"pixel_values": Tensor, "image_grid_thw": Tensor, ...},
        "video": {...}, "audio": {...},
        "multimodal_embed_mask_cumsum": Tensor,          # int64 CPU, [prompt_len]
        "multimodal_embedding_lengths": list[int],
        "multimodal_encoder_item_metadata": MultimodalEncoderItemMetadata,
    }
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # runtime.py imports this module; avoid the cycle at import time.
    from epd.multimodal.runtime import MultimodalRuntimeData

MULTIMODAL_ENCODER_ITEM_METADATA_KEY = "multimodal_encoder_item_metadata"

# Bookkeeping that Python reads element by element on the scheduling path.
# On an accelerator every ``int(cs[idx])`` would be a device-to-host sync.
CPU_ONLY_MULTIMODAL_DATA_KEYS = frozenset(
    {
        "multimodal_embed_mask_cumsum",
        "multimodal_embedding_lengths",
        MULTIMODAL_ENCODER_ITEM_METADATA_KEY,
    }
)

# Keys that describe a request but carry nothing to encode (mrope warmup
# requests, context requests that only hold special-token offsets).
MM_METADATA_ONLY_KEYS = frozenset(
    {
        "mrope_config",
        *CPU_ONLY_MULTIMODAL_DATA_KEYS,
        "special_token_offsets",
        "layout_metadata",
    }
)

_ENCODER_INPUT_KEYS = ("image", "video", "audio")


def has_mm_payload_keys(mm_data: dict | None) -> bool:
    """True iff ``mm_data`` holds a real payload (image/video/audio/embedding)."""
    if not mm_data:
        return False
    return bool(set(mm_data) - MM_METADATA_ONLY_KEYS)


@dataclass
class MultimodalParams:
    multimodal_data: dict = field(default_factory=dict)
    # One BLAKE3 hexdigest per item, in prompt order (see hashing.py).
    multimodal_hashes: list[str] | None = None
    # None on full, no-reuse prefill: the whole payload is consumed in one forward.
    multimodal_runtime: MultimodalRuntimeData | None = None
    # Signalled once this request's encoder outputs are committed.
    encoder_event: object | None = None

    def has_content(self) -> bool:
        return has_mm_payload_keys(self.multimodal_data)

    def to_device(
        self,
        element: str,
        device: str | torch.device,
        *,
        pin_memory: bool = False,
        target_keywords: list[str] | None = None,
    ) -> None:
        """Move the tensors of ``self.<element>`` (a nested dict) to ``device``.

        ``target_keywords`` are dotted paths ("image.pixel_values",
        "multimodal_embedding"); when given, only tensors at or under those paths
        move, because the model declares what its forward reads on device.
        CPU-only bookkeeping keys never move. The dict is rebuilt rather than
        mutated so a caller still holding the original keeps its CPU payload.
        """
        data = getattr(self, element, None)
        if not isinstance(data, dict):
            raise ValueError(
                f"to_device expects MultimodalParams.{element} to be a dict, "
                f"got {type(data).__name__}"
            )
        mover = _TensorMover(torch.device(device), pin_memory, target_keywords)
        moved = mover.move_dict(data, path="")
        _check_cpu_only_keys(moved)
        setattr(self, element, moved)


@dataclass(frozen=True)
class _TensorMover:
    device: torch.device
    pin_memory: bool
    target_keywords: list[str] | None

    def move_dict(self, data: dict, path: str) -> dict:
        return {key: self._move_entry(key, value, path) for key, value in data.items()}

    def _move_entry(self, key: object, value: Any, path: str) -> Any:
        # Matched by name at any depth, whatever target_keywords says.
        if key in CPU_ONLY_MULTIMODAL_DATA_KEYS:
            return value
        return self.move(value, _join(path, key))

    def move(self, value: Any, path: str) -> Any:
        # List/tuple elements share their container's path: "multimodal_embedding"
        # names every tensor in a list of per-item embeddings.
        if isinstance(value, torch.Tensor):
            return self._move_tensor(value) if self._is_target(path) else value
        if isinstance(value, dict):
            return self.move_dict(value, path)
        if isinstance(value, (list, tuple)):
            moved = [self.move(element, path) for element in value]
            if hasattr(value, "_fields"):  # NamedTuple: positional constructor
                return type(value)(*moved)
            return type(value)(moved)
        return value

    def _is_target(self, path: str) -> bool:
        if self.target_keywords is None:
            return True
        return any(path == key or path.startswith(key + ".") for key in self.target_keywords)

    def _move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        # Pinned host memory is what makes the H2D copy truly asynchronous.
        if self.device.type == "cuda" and self.pin_memory and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_cpu_only_keys(data: dict) -> None:
    for key in CPU_ONLY_MULTIMODAL_DATA_KEYS & data.keys():
        for tensor in _tensors_in(data[key]):
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"multimodal_data[{key!r}] must stay on CPU (Python reads it element "
                    f"by element), but it holds a tensor on {tensor.device}"
                )


def _tensors_in(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def strip_mm_data_for_generation(mm_data: dict) -> None:
    """Clear ``mm_data`` in place, keeping only ``mrope_config.mrope_position_deltas``.

    After prefill the embeddings are in the KV cache, but every decode step still
    adds the mrope position delta, so that one tensor lives until the request ends.
    """
    mrope_config = mm_data.get("mrope_config")
    mrope_deltas = None
    if isinstance(mrope_config, dict):
        mrope_deltas = mrope_config.get("mrope_position_deltas")
    mm_data.clear()
    if mrope_deltas is not None:
        mm_data["mrope_config"] = {"mrope_position_deltas": mrope_deltas}


def strip_mm_encoder_inputs(mm_data: dict) -> None:
    """Drop raw encoder payloads (pixels, frames, waveforms) in place.

    Once every item is encoded the raw modality dicts are dead weight, and left
    in place they would be copied to the device by LLM input preparation.
    Cached embeddings and bookkeeping keys are kept.
    """
    for modality in _ENCODER_INPUT_KEYS:
        mm_data.pop(modality, None)
