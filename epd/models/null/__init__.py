"""The zero-cost model: a benchmark tool that measures EPD, not a model (``epd.models.null.family``)."""
