"""The OpenAI-compatible HTTP front end (``app.build_app``): chat completions, completions,
tokenize, models, health and metrics, as the official ``openai`` client and vLLM's users call them."""
