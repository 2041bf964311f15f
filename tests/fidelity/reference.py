"""transformers' own generate, the reference our engine must match token for token."""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor


@dataclass
class Reference:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated token: [V] log-softmax of the raw logits


class ReferenceModel:
    def __init__(self, model_dir) -> None:
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = _processor(model_dir)
        self.eos_token_id = self.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    @torch.inference_mode()
    def generate(self, messages: list[dict], images: list[bytes], max_new_tokens: int = 32) -> Reference:
        text = self.processor.apply_chat_template(_markers_only(messages), tokenize=False,
                                                  add_generation_prompt=True)
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        inputs = self.processor(text=[text], images=pil or None, return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True,
                                  eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id)
        prompt = inputs["input_ids"][0].tolist()
        generated = out.sequences[0, len(prompt):].tolist()
        return Reference(prompt, generated, [torch.log_softmax(l[0].float(), -1) for l in out.logits])


class _ImageOnlyProcessor(Qwen2VLProcessor):
    """transformers' Qwen2-VL processor without its video processor, which needs torchvision
    (not installable beside the CPU torch wheel); image handling is the unmodified original."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _processor(model_dir) -> Qwen2VLProcessor:
    # Qwen2.5-VL uses the same image processor and placeholder expansion
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return _ImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir),
                               tokenizer=tokenizer, video_processor=None,
                               chat_template=tokenizer.chat_template)


def _markers_only(messages: list[dict]) -> list[dict]:
    """The template only needs to know where images go."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if p["type"] == "image" else p for p in content]
        out.append({**m, "content": content})
    return out


def user_message(text: str, images: list[bytes]) -> list[dict]:
    parts = [{"type": "image", "image": b} for b in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]
