"""Shared by the engine's tests."""
import pytest
import torch

from epd.config import EngineConfig
from epd.models.locate import resolve_model
from epd.models.registry import load_llm_for


@pytest.fixture(scope="module")
def model():
    """The tiny preset's LLM on the CPU, seeded, loaded once per module (engines are built around it)."""
    torch.manual_seed(0)
    return load_llm_for(resolve_model("tiny-qwen2-vl"), EngineConfig(device="cpu"))
