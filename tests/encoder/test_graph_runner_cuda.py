"""Capture and replay of a small fake block loop; runs on any CUDA machine, skipped elsewhere."""
import pytest
import torch

from epd.encoder.graph_runner import (
    CuSeqlensMetadataProvider,
    EncoderGraphKey,
    EncoderGraphTensorSpec,
    MultimodalEncoderGraphRunner,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HIDDEN = 32


class FakeBlockLoop(torch.nn.Module):
    """Token-wise Linear blocks plus a per-context term read from cu_seqlens (graph-safe ops only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3))

    def forward(self, inputs, metadata):
        x = inputs["hidden_states"]
        for block in self.blocks:
            x = x + torch.nn.functional.gelu(block(x))
        positions = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
        context_ids = torch.searchsorted(metadata.cu_seqlens[1:], positions, right=True)
        return {"hidden_states": x + context_ids.unsqueeze(-1).to(x.dtype)}


def make_runner(model, buckets=((64, 2), (128, 4))):
    return MultimodalEncoderGraphRunner(
        model, buckets=buckets, input_specs={"hidden_states": EncoderGraphTensorSpec((HIDDEN,), torch.float32)},
        output_specs={"hidden_states": 0}, metadata_provider=CuSeqlensMetadataProvider(), device="cuda")


def eager(model, x, seq_lengths):
    provider = CuSeqlensMetadataProvider()
    metadata = provider.create(EncoderGraphKey(x.shape[0], len(seq_lengths)), x.device)
    provider.prepare(metadata, seq_lengths)
    with torch.no_grad():
        return model({"hidden_states": x}, metadata)["hidden_states"]


@pytest.mark.parametrize("seq_lengths", [[10], [30, 34], [64], [50, 20, 30, 20]])
def test_graph_replay_equals_eager(seq_lengths):
    model = FakeBlockLoop().cuda()
    runner = make_runner(model)
    assert runner.captured_keys == [(65, 3), (129, 5)]
    x = torch.randn(sum(seq_lengths), HIDDEN, device="cuda")
    out = runner.maybe_run({"hidden_states": x}, seq_lengths)["hidden_states"]
    torch.cuda.synchronize()
    assert out.shape == (sum(seq_lengths), HIDDEN)
    torch.testing.assert_close(out, eager(model, x, seq_lengths), rtol=1e-4, atol=1e-4)


def test_graph_outputs_alias_captured_memory_and_oversize_runs_eager():
    runner = make_runner(FakeBlockLoop().cuda())
    first = runner.maybe_run({"hidden_states": torch.randn(20, HIDDEN, device="cuda")}, [20])["hidden_states"]
    second = runner.maybe_run({"hidden_states": torch.randn(40, HIDDEN, device="cuda")}, [40])["hidden_states"]
    assert first.data_ptr() == second.data_ptr()  # same bucket: no new allocation per replay
    assert runner.maybe_run({"hidden_states": torch.randn(200, HIDDEN, device="cuda")}, [200]) is None


def test_graph_replay_refuses_moved_metadata():
    runner = make_runner(FakeBlockLoop().cuda(), buckets=((64, 2),))
    captured = runner._graphs[EncoderGraphKey(64, 2)]
    captured.metadata.cu_seqlens = captured.metadata.cu_seqlens.clone()
    with pytest.raises(RuntimeError, match="metadata.cu_seqlens moved"):
        runner.maybe_run({"hidden_states": torch.randn(8, HIDDEN, device="cuda")}, [8])

