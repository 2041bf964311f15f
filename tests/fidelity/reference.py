"""transformers' own generate, the reference our engine must match token for token."""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from epd.models.presets import load_processor


@dataclass
class Reference:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated token: [V] log-softmax of the raw logits


class ReferenceModel:
    def __init__(self, model_dir, dtype: torch.dtype = torch.float32) -> None:
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
        self.processor = load_processor(model_dir)
        self.eos_token_id = self.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    @torch.inference_mode()
    def generate(self, messages: list[dict], images: list[bytes], max_new_tokens: int = 32, *,
                 processor_kwargs: dict | None = None, **generate_kwargs) -> Reference:
        """Greedy ``generate``; ``generate_kwargs``: its logits processors (repetition_penalty, ...);
        ``processor_kwargs``: ``min_pixels`` / ``max_pixels`` for the image processor (as its
        ``size`` bounds, transformers 5's form)."""
        text = self.processor.apply_chat_template(_markers_only(messages), tokenize=False,
                                                  add_generation_prompt=True)
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        size = {}
        if processor_kwargs:
            own = self.processor.image_processor.size
            size = {"size": {"shortest_edge": processor_kwargs.get("min_pixels", own.shortest_edge),
                             "longest_edge": processor_kwargs.get("max_pixels", own.longest_edge)}}
        inputs = self.processor(text=[text], images=pil or None, return_tensors="pt", **size)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True,
                                  eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id, **generate_kwargs)
        prompt = inputs["input_ids"][0].tolist()
        generated = out.sequences[0, len(prompt):].tolist()
        return Reference(prompt, generated, [torch.log_softmax(l[0].float(), -1) for l in out.logits])


    @torch.inference_mode()
    def generate_with_videos(self, messages: list[dict], images: list[bytes], videos: list[tuple],
                             max_new_tokens: int = 32) -> Reference:
        """Greedy ``generate`` of a prompt with videos. transformers' video processor needs
        torchvision, which does not load beside the CPU torch here, so each video comes as
        ``(pixel_values_videos, video_grid_thw [1, 3], second_per_grid_t)`` made by our own frame
        pipeline (tested against transformers' image processor); the prompt's placeholders are
        expanded by transformers' processors' rule (grid.prod() // merge**2) and the model gets
        ``mm_token_type_ids`` as its processor makes them."""
        text = self.processor.apply_chat_template(_markers_only(messages), tokenize=False,
                                                  add_generation_prompt=True)
        tok = self.processor.tokenizer
        image_id, video_id = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
        if self.model.config.model_type == "qwen3_vl":  # frames between timestamps, by its processor's own code
            text, videos = self._qwen3_video_text(text, videos), [v[:3] for v in videos]
        kwargs: dict = {}
        image_rows: list[int] = []
        if images:
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            out = self.processor.image_processor(images=pil, return_tensors="pt")
            kwargs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
            image_rows = (out["image_grid_thw"].prod(-1) // 4).tolist()
        video_rows = [int(grid.prod()) // 4 for _, grid, *_ in videos]
        if videos:
            kwargs.update(pixel_values_videos=torch.cat([v[0] for v in videos]),
                          video_grid_thw=torch.cat([v[1] for v in videos]))
            if self.model.config.model_type == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = torch.tensor([v[2] for v in videos])
        ids, rows = [], {image_id: iter(image_rows)}
        if self.model.config.model_type != "qwen3_vl":  # Qwen3-VL's video placeholders are expanded in the text
            rows[video_id] = iter(video_rows)
        for t in tok.encode(text, add_special_tokens=False):
            ids += [t] * next(rows[t]) if t in rows else [t]
        input_ids = torch.tensor([ids])
        types = (input_ids == image_id).int() + 2 * (input_ids == video_id).int()
        out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  mm_token_type_ids=types, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id, **kwargs)
        return Reference(ids, out[0, len(ids):].tolist(), [])


    def _qwen3_video_text(self, text: str, videos: list[tuple]) -> str:
        """Qwen3-VL's processor writes each video as one placeholder run per temporal patch, each
        after its timestamp (``replace_video_token``); videos are (pixels, grid, seconds per patch,
        frames_indices, source fps)."""
        from transformers.video_utils import VideoMetadata

        wrapper = "<|vision_start|><|video_pad|><|vision_end|>"
        for _, grid, _, indices, fps in videos:
            metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=list(indices))
            self.processor.video_processor = _MergeSize()  # the one attribute replace_video_token reads
            placeholder = self.processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]},
                                                             0)
            text = text.replace(wrapper, placeholder, 1)
        return text


class _MergeSize:
    merge_size = 2
    temporal_patch_size = 2


def _markers_only(messages: list[dict]) -> list[dict]:
    """The template only needs to know where images and videos go."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": p["type"]} if p["type"] in ("image", "video") else p for p in content]
        out.append({**m, "content": content})
    return out


def user_message(text: str, images: list[bytes]) -> list[dict]:
    parts = [{"type": "image", "image": b} for b in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]
