"""Qwen3-VL: the Qwen3 decoder with interleaved M-RoPE and deepstack, and transformers' own vision tower."""
