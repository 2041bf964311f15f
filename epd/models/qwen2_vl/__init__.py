"""Qwen2-VL and Qwen2.5-VL: the family object, our LLM, transformers' vision tower, the input
processor and M-RoPE."""
