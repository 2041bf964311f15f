"""The vision half of Qwen2-VL / Qwen2.5-VL: transformers' own vision tower and image processor,
loaded with the checkpoint's weights. The encoder tier runs this and nothing else of the model."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig

from epd.models.checkpoint import iter_weights, read_preprocessor_config
from epd.models.layers import to_keeping_float32_buffers
from epd.multimodal.media import decode_image

_VISION_PREFIXES = ("model.visual.", "visual.")


def _tower_class(model_type: str) -> type:
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        return Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    return Qwen2VisionTransformerPretrainedModel


def _image_processor(model_dir: Path):
    # the PIL processor needs no torchvision; its output equals the fast one's on the same image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    cfg = {k: v for k, v in read_preprocessor_config(model_dir).items()
           if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**cfg)


class QwenVisionEncoder:
    """images (encoded bytes) -> pixel patches -> per-item embedding rows ``[rows_i, out_hidden]``."""

    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        model_dir = Path(model_dir)
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.model_type = hf_config.model_type
        self.vision_config = hf_config.vision_config
        self.spatial_merge_size = self.vision_config.spatial_merge_size
        self.tower = _tower_class(self.model_type)._from_config(self.vision_config)
        self._load_weights(model_dir)
        to_keeping_float32_buffers(self.tower, device=device, dtype=dtype).eval()
        self.dtype, self.device = dtype, torch.device(device)
        self.image_processor = _image_processor(model_dir)

    @property
    def embedding_dim(self) -> int:
        """Width of one output row (the declared dim of a cached embedding row)."""
        cfg = self.vision_config
        return getattr(cfg, "out_hidden_size", None) or cfg.hidden_size

    @property
    def embedding_dtype(self) -> torch.dtype:
        return self.dtype

    def _load_weights(self, model_dir: Path) -> None:
        state = {}
        for name, tensor in iter_weights(model_dir):
            for prefix in _VISION_PREFIXES:
                if name.startswith(prefix):
                    state[name[len(prefix):]] = tensor
        missing, unexpected = self.tower.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights in {model_dir} do not match the tower: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")

    def preprocess(self, images: list[bytes], processor_kwargs: Sequence[Mapping | None] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> pixel_values [sum patches, C*T*P*P], grid_thw [N, 3] (CPU). ``processor_kwargs``: per
        image, its ``min_pixels`` / ``max_pixels`` (None: the checkpoint's); images that share them
        are processed in one call, in order."""
        pil = [decode_image(data) for data in images]  # size/bomb limits before any pixels decode
        kwargs = list(processor_kwargs) if processor_kwargs is not None else [None] * len(pil)
        if len(kwargs) != len(pil):
            raise ValueError(f"{len(kwargs)} processor kwargs for {len(pil)} images")
        pixels, grids, start = [], [], 0
        for end in range(1, len(pil) + 1):  # runs of equal kwargs
            if end == len(pil) or kwargs[end] != kwargs[start]:
                out = self.image_processor(images=pil[start:end], return_tensors="pt", **_size_of(kwargs[start]))
                pixels.append(out["pixel_values"])
                grids.append(out["image_grid_thw"])
                start = end
        return torch.cat(pixels), torch.cat(grids)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One batched tower forward over several items -> rows per item, in order."""
        pixel_values = pixel_values.to(self.device, self.dtype)
        merged = self.tower(pixel_values, grid_thw=grid_thw.to(self.device)).pooler_output
        return self.split_rows(merged, grid_thw.cpu())

    def block_loop(self):
        """The tower cut into eager prelude, capturable block loop and eager postlude;
        the encoder tier's graph runner captures the block loop."""
        from epd.models.qwen2_vl.vision_blocks import QwenVisionBlockLoop
        return QwenVisionBlockLoop(self.tower, self.model_type)

    def split_rows(self, merged: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Merged rows of a batch -> rows per item, in order."""
        return list(torch.split(merged, (grid_thw.prod(-1) // self.spatial_merge_size ** 2).tolist()))

    def encode_images(self, images: list[bytes], processor_kwargs: Sequence[Mapping | None] | None = None
                      ) -> list[torch.Tensor]:
        return self.encode(*self.preprocess(images, processor_kwargs)) if images else []


def _size_of(kwargs: Mapping | None) -> dict:
    """A request's min/max_pixels as the image processor's ``size`` (transformers 5 names them
    shortest_edge / longest_edge); nothing when the checkpoint's own apply."""
    if not kwargs:
        return {}
    return {"size": {"shortest_edge": kwargs["min_pixels"], "longest_edge": kwargs["max_pixels"]}}
