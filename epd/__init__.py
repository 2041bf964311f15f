"""EPD: Encode / Prefill / Decode disaggregated serving for vision-language models."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # lazy: ``import epd`` must stay cheap for the CLI and the tier processes
    if name == "LLM":
        from epd.llm import LLM
        return LLM
    if name == "SamplingParams":
        from epd.types import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'epd' has no attribute {name!r}")
