"""The multimodal data layer: content hashing, placeholder masks and their cumsum, prompt layout,
per-chunk row accounting, embedding fusion, budgets, media loading and image geometry. It imports
no tier, no engine and no router."""
