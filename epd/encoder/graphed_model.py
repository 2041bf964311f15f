"""An encoder model whose vision block loop replays CUDA graphs.

The model side supplies the cut (``model.block_loop()``: eager prelude, capturable block loop with
its metadata provider, eager postlude); this tier owns the runner that captures it per bucket.
A batch that fits no bucket runs the model's own eager forward, so graphs never limit what the
encoder accepts.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from epd.encoder.graph_runner import EncoderGraphTensorSpec, MultimodalEncoderGraphRunner

log = logging.getLogger(__name__)


class GraphedVisionEncoder:
    """Wraps an ``EncoderModel`` with ``block_loop()`` and ``split_rows()`` (``QwenVisionEncoder``)."""

    def __init__(self, model, buckets: Iterable[tuple[int, int]], *, device: str | torch.device) -> None:
        self.model = model
        self.loop = model.block_loop()
        specs = {name: EncoderGraphTensorSpec(shape, dtype) for name, (shape, dtype) in self.loop.input_specs().items()}
        self.runner = MultimodalEncoderGraphRunner(
            self.loop.block_loop, buckets=buckets, input_specs=specs, output_specs=self.loop.output_specs,
            metadata_provider=self.loop.metadata_provider, device=device)
        self.num_graph_batches = 0
        self.num_eager_batches = 0
        log.info("encoder CUDA graphs captured for %d buckets (padded keys %s)", len(self.runner.buckets),
                 [tuple(k) for k in self.runner.captured_keys])

    # what the runner reads of any EncoderModel
    @property
    def embedding_dim(self) -> int:
        return self.model.embedding_dim

    @property
    def embedding_dtype(self) -> torch.dtype:
        return self.model.embedding_dtype

    @property
    def device_inputs(self):
        return getattr(self.model, "device_inputs", None)

    def preprocess(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.preprocess(inputs)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        seq_lengths = self.loop.seq_lengths(grid_thw)
        if self.runner.select_bucket(sum(seq_lengths), len(seq_lengths)) is None:
            self.num_eager_batches += 1
            return self.model.encode(pixel_values, grid_thw)
        prelude = self.loop.prelude(pixel_values.to(self.runner.device, self.model.embedding_dtype), grid_thw)
        outputs = self.runner.maybe_run(prelude.inputs, prelude.seq_lengths)
        self.num_graph_batches += 1
        # the outputs alias the graph's memory until the next replay; the merger makes new tensors
        return self.model.split_rows(self.loop.postlude(outputs["hidden_states"], prelude), grid_thw.cpu())
