"""TensorSplit: cutting, joining and in-place writing of tensor-parallel slices are one rule."""

import itertools

import pytest
import torch

from shardwise.checkpoint import TensorSplit, create_tensor_file, read_tensors, seal_tensor_file, write_slice_into
from shardwise.tensor_parallel.autotp import _interleave_blocks

CASES = [
    ((8, 6), 0, 1, False),
    ((8, 6), 1, 1, False),
    ((12, 4), 0, 3, False),
    ((12, 4), 0, 3, True),
    ((6, 8), 1, 1, True),
    ((8, 6), 0, 1, True),
    ((16,), 0, 2, False),
    ((4, 6, 8), 2, 2, False),
]


@pytest.mark.parametrize("shape,dim,stride,transposed", CASES)
def test_slice_join_and_positions_agree(shape, dim, stride, transposed):
    parts = 2
    stored_shape = shape[::-1] if transposed else shape
    stored = torch.arange(torch.Size(stored_shape).numel()).reshape(stored_shape)
    splits = [TensorSplit(shape, dim, index, parts, stride, transposed) for index in range(parts)]
    slices = [s.slice_of(stored) for s in splits]
    assert all(tuple(t.shape) == s.held_shape for t, s in zip(slices, splits))
    assert torch.equal(splits[0].full_from(slices), stored)
    for split, held in zip(splits, slices):
        n = held.numel()
        assert torch.equal(split.positions(0, n), held.reshape(-1))  # stored holds its own flat index
        assert torch.equal(split.positions(3, n - 1), held.reshape(-1)[3 : n - 1])


def test_slice_matches_autotp_interleave_and_transpose():
    """A GPT-2-like stacked [in, 3 * out] Conv1D weight: AutoTP's shard of rank r is what
    TensorSplit cuts from the Hugging Face tensor."""
    hf = torch.randn(4, 12)  # Conv1D stores [in, out]; out = q|k|v of 4 each
    weight, _ = _interleave_blocks(hf.t(), None, blocks=3, tp=2, name="c_attn")
    for r in range(2):
        split = TensorSplit((12, 4), 0, r, 2, stride=3, transposed=True)
        assert torch.equal(split.slice_of(hf), weight[r * 6 : (r + 1) * 6])


def test_ranks_write_their_ranges_in_place(tmp_path):
    """Every (tensor rank, ZeRO range) writes its elements of a slice into one stored
    tensor: the file then holds the full tensor."""
    for shape, dim, stride, transposed in CASES:
        parts = 2
        stored_shape = shape[::-1] if transposed else shape
        full = torch.randn(stored_shape)
        path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.safetensors"
        offsets = create_tensor_file(path, [("w", torch.float32, list(stored_shape))])
        for index, (lo, hi) in itertools.product(range(parts), [(0, 5), (5, 9), (9, None)]):
            split = TensorSplit(shape, dim, index, parts, stride, transposed)
            held = split.slice_of(full).reshape(-1)
            hi = held.numel() if hi is None else hi
            write_slice_into(path, offsets["w"], split, lo, held[lo:hi])
        record = seal_tensor_file(path)
        got = read_tensors(tmp_path, path.name, manifest={"files": {path.name: record}})["w"]
        assert torch.equal(got, full), (shape, dim, stride, transposed)


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="does not split into 3 block"):
        TensorSplit((10, 4), 0, 0, 2, stride=3)
    with pytest.raises(ValueError, match="only a 2-D tensor"):
        TensorSplit((4,), 0, 0, 2, transposed=True)
    with pytest.raises(ValueError, match="expected \\[8, 4\\]"):
        TensorSplit((8, 4), 0, 0, 2).slice_of(torch.zeros(4, 8))
