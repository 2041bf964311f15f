"""The vision half of Qwen2-VL / Qwen2.5-VL: transformers' own vision tower and image processor,
loaded with the checkpoint's weights, and videos made into the same patches (frames sampled and
decoded by ``multimodal.video``). The encoder tier runs this and nothing else of the model."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig
from transformers.image_utils import SizeDict

from epd.models.checkpoint import iter_weights, read_preprocessor_config, read_video_preprocessor_config
from epd.models.layers import to_keeping_float32_buffers
from epd.multimodal.geometry import VisionGeometryConfig
from epd.multimodal.media import MediaInput, decode_image
from epd.multimodal.video import VideoSampling, decode_frames, video_geometry_from_bytes

_VISION_PREFIXES = ("model.visual.", "visual.")


def tower_class(model_type: str) -> type:
    """transformers' vision tower class for ``model_type`` (imported here: ~2 s of CPU)."""
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionModel
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
        self.tower = tower_class(self.model_type)._from_config(self.vision_config)
        self._load_weights(model_dir)
        to_keeping_float32_buffers(self.tower, device=device, dtype=dtype).eval()
        self.dtype, self.device = dtype, torch.device(device)
        self.image_processor = _image_processor(model_dir)
        self.video_sampling = VideoSampling.from_preprocessor_config(read_video_preprocessor_config(model_dir))

    @property
    def deepstack_levels(self) -> int:
        """Intermediate feature levels each row carries after its main embedding (Qwen3-VL)."""
        return len(getattr(self.vision_config, "deepstack_visual_indexes", None) or ())

    @property
    def embedding_dim(self) -> int:
        """Width of one output row (the declared dim of a cached embedding row): the LLM's hidden
        size, times one plus the deepstack levels packed beside it (``qwen3_vl.family``)."""
        cfg = self.vision_config
        return (getattr(cfg, "out_hidden_size", None) or cfg.hidden_size) * (1 + self.deepstack_levels)

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

    def preprocess(self, inputs: Sequence[MediaInput | bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and videos (plain bytes: an image) -> pixel_values [sum patches, C*T*P*P] and
        grid_thw [N, 3] (CPU), in order. Images that share processor kwargs go through the image
        processor in one call; a video is sampled, decoded and patched alone."""
        items = [MediaInput.of(x) for x in inputs]
        pixels, grids, start = [], [], 0
        for end in range(1, len(items) + 1):
            if end < len(items) and _same_run(items[start], items[end]):
                continue
            run = items[start:end]
            patches, grid = self._video(run[0]) if run[0].modality == "video" else self._images(run)
            pixels.append(patches)
            grids.append(grid)
            start = end
        return torch.cat(pixels), torch.cat(grids)

    def _images(self, run: list[MediaInput]) -> tuple[torch.Tensor, torch.Tensor]:
        pil = [decode_image(item.data) for item in run]  # size/bomb limits before any pixels decode
        out = self.image_processor(images=pil, return_tensors="pt", **_size_of(run[0].processor_kwargs))
        return out["pixel_values"], out["image_grid_thw"]

    def _video(self, item: MediaInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames sampled and resized like the model's images, cut into temporal patches in the
        order transformers' Qwen2-VL video processor uses."""
        sampling = self.video_sampling.with_kwargs(item.processor_kwargs, ceiling=self.video_sampling)
        geometry = video_geometry_from_bytes(item.data, sampling)
        ip, cfg = self.image_processor, sampling.geometry
        size = SizeDict(shortest_edge=cfg.min_pixels, longest_edge=cfg.max_pixels)
        frames = []
        for frame in decode_frames(item.data, geometry):  # [H, W, 3] RGB uint8
            chw = ip.resize(frame.transpose(2, 0, 1), size=size, resample=ip.resample, factor=cfg.factor_px)
            frames.append(ip.normalize(ip.rescale(chw, ip.rescale_factor), ip.image_mean, ip.image_std))
        video = torch.from_numpy(np.stack(frames))  # [T, C, H, W]
        return patchify_video(video, cfg), torch.tensor([geometry.grid_thw])

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One batched tower forward over several items -> rows per item, in order."""
        pixel_values = pixel_values.to(self.device, self.dtype)
        out = self.tower(pixel_values, grid_thw=grid_thw.to(self.device))
        # Qwen3-VL: each row packs its deepstack levels after the main embedding, [main | level 1 | ...]
        merged = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1) if self.deepstack_levels \
            else out.pooler_output
        return self.split_rows(merged, grid_thw.cpu())

    @property
    def block_loop(self):
        """A factory of the tower cut into eager prelude, capturable block loop and eager postlude
        (the encoder tier's graph runner captures the block loop); None for Qwen3-VL's tower, whose
        blocks also emit deepstack levels (it runs eager)."""
        if self.model_type not in ("qwen2_vl", "qwen2_5_vl"):
            return None
        from epd.models.qwen2_vl.vision_blocks import QwenVisionBlockLoop
        return lambda: QwenVisionBlockLoop(self.tower, self.model_type)

    def split_rows(self, merged: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Merged rows of a batch -> rows per item, in order."""
        return list(torch.split(merged, (grid_thw.prod(-1) // self.spatial_merge_size ** 2).tolist()))

    def encode_images(self, inputs: Sequence[MediaInput | bytes]) -> list[torch.Tensor]:
        """Rows of each image or video (plain bytes: an image), in order."""
        return self.encode(*self.preprocess(inputs)) if inputs else []


def _same_run(a: MediaInput, b: MediaInput) -> bool:
    return a.modality == b.modality == "image" and a.processor_kwargs == b.processor_kwargs


def patchify_video(video: torch.Tensor, cfg: VisionGeometryConfig) -> torch.Tensor:
    """[T, C, H, W] normalized frames -> [t*h*w, C*tps*P*P] patches (T padded to a multiple of the
    temporal patch size with the last frame), merge-window order as transformers' video processor."""
    tps, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -video.shape[0] % tps:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video.shape
    gt, gh, gw = frames // tps, height // p, width // p
    patches = video.reshape(gt, tps, channels, gh // m, m, p, gw // m, m, p)
    return patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, channels * tps * p * p)


def _size_of(kwargs: Mapping | None) -> dict:
    """A request's min/max_pixels as the image processor's ``size`` (transformers 5 names them
    shortest_edge / longest_edge); nothing when the checkpoint's own apply."""
    if not kwargs:
        return {}
    return {"size": {"shortest_edge": kwargs["min_pixels"], "longest_edge": kwargs["max_pixels"]}}
