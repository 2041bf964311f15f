"""A fake vision encoder and item helpers: items describe themselves in their bytes."""
from __future__ import annotations

import threading

import torch

from epd.encoder.item_scheduler import EncoderItem
from epd.multimodal.media import MediaError

HIDDEN = 4
BYTES_PER_ROW = HIDDEN * 4  # float32


def make_item(name: str, rows: int = 2, tokens: int | None = None) -> EncoderItem:
    """An item whose bytes say what to produce; ``name`` is its content hash."""
    return EncoderItem(data=f"{name}:{rows}".encode(), content_hash=name, processor_kwargs_hash="kw",
                       expected_rows=rows, encoder_tokens=tokens if tokens is not None else rows * 4)


def expected_output(name: str, rows: int = 2) -> torch.Tensor:
    value = float(sum(name.encode()))
    return torch.arange(rows * HIDDEN, dtype=torch.float32).reshape(rows, HIDDEN) + value


class FakeEncoder:
    """``preprocess``/``encode`` like QwenVisionEncoder, with failure switches and a call log."""

    embedding_dim = HIDDEN
    embedding_dtype = torch.float32
    device_inputs = ("pixel_values",)

    def __init__(self) -> None:
        self.batches: list[list[str]] = []  # names per encode call
        self.devices: list[tuple[str, str]] = []  # (pixel_values, grid_thw) device types per call
        self.fail_next_encodes = 0
        self.wrong_rows: dict[str, int] = {}  # name -> rows actually produced
        self.wrong_dtype: set[str] = set()
        self.undecodable: set[str] = set()  # names whose media do not decode (preprocess refuses them)
        self.entered = threading.Event()  # set when an encode starts
        self.hold: threading.Event | None = None  # when set to an Event: encode waits for it (a slow forward)
        self._lock = threading.Lock()

    def preprocess(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        pending = [getattr(x, "data", x).decode().split(":") for x in inputs]
        if bad := [name for name, _ in pending if name in self.undecodable]:
            raise MediaError(f"PNG data is truncated or corrupt ({bad[0]})")
        self._pending = pending
        rows = [int(r) for _, r in self._pending]
        return torch.ones(sum(rows) * 4, 3), torch.tensor([[1, 2 * r, 2] for r in rows])

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        with self._lock:
            names = [name for name, _ in self._pending]
            self.batches.append(names)
            self.devices.append((pixel_values.device.type, grid_thw.device.type))
            if self.fail_next_encodes:
                self.fail_next_encodes -= 1
                raise RuntimeError("CUDA out of memory (fake)")
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(30), "the test never let the encode finish"
        outputs = []
        for name, rows in self._pending:
            out = expected_output(name, self.wrong_rows.get(name, int(rows)))
            outputs.append(out.to(torch.float16) if name in self.wrong_dtype else out)
        # like torch.split of one merged tensor: views sharing one storage
        return list(torch.cat(outputs).split([o.shape[0] for o in outputs])) if not self.wrong_dtype else outputs

    @property
    def encoded_names(self) -> list[str]:
        return [name for batch in self.batches for name in batch]
