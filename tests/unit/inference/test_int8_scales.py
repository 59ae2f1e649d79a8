"""Weight-only int8 keeps one scale per output feature of every layer (see
``inference/_quant.py``), checked by value: the accuracy bound of ``test_int8.py`` cannot
tell per-output from per-input scales apart.

Each layer's weight has one output row 100x larger than the rest. With one scale per
output row, every row reaches |q| = 127 and the small rows keep their own resolution
(relative error ~1e-3); scales per input channel would be set by the large row, leaving
the small rows with a step 100x too coarse.
"""

import pytest
import torch
from torch import nn

from shardwise.inference._quant import int8_parts, quantize_linears

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402 -- after the skip


def _with_one_large_output_row(weight: torch.Tensor, out_dim: int) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator))
        weight.narrow(out_dim, 1, 1).mul_(100.0)


def _layers():
    square, wide, conv = nn.Linear(16, 16), nn.Linear(16, 24), Conv1D(24, 16)  # Conv1D: [in, out] weight
    for layer, out_dim in ((square, 0), (wide, 0), (conv, 1)):
        _with_one_large_output_row(layer.weight, out_dim)
    return {"square": (square, 0), "wide": (wide, 0), "conv1d": (conv, 1)}


@pytest.mark.parametrize("name", ["square", "wide", "conv1d"])
def test_one_scale_per_output_feature_sets_every_rows_own_range(name):
    layer, out_dim = _layers()[name]
    original = layer.weight.detach().clone()
    quantize_linears(nn.Sequential(layer), dtype=torch.float32)
    q, scale = int8_parts(layer)
    rows = q.movedim(out_dim, 0)
    want_rows, got_rows = original.movedim(out_dim, 0), layer.weight.detach().movedim(out_dim, 0)
    assert scale.shape == (rows.shape[0],)
    assert rows.abs().amax(dim=1).tolist() == [127] * rows.shape[0]
    torch.testing.assert_close(scale, want_rows.abs().amax(dim=1) / 127)
    relative = (got_rows - want_rows).norm(dim=1) / want_rows.norm(dim=1)
    assert relative.max().item() < 1e-2, relative
