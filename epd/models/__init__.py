"""Model families (a lazy registry by ``model_type``), checkpoints, presets and tokenizers."""
