"""Load a checkpoint's tokenizer and make sure it carries a chat template."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from epd.models.checkpoint import read_chat_template


def load_tokenizer(model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        template = read_chat_template(model_dir)
        if template is None:
            raise ValueError(f"{model_dir} has no chat template (chat_template.jinja, chat_template.json "
                             f"or tokenizer_config.json)")
        tokenizer.chat_template = template
    return tokenizer
