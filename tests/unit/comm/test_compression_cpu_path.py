"""The CPU path of 1-bit compression ([Note: compression on the CPU], NumPy on the tensors'
memory) gives the same bytes, the same fp32 bit patterns and the same error buffers as the
torch path that other devices run, including -0.0, zeros, infinities and NaN."""

import pytest
import torch

from shardwise.comm import _compressed
from shardwise.comm._compressed import compress, decompress, pack_bits, pack_signs, unpack_bits


def _values(rows: int, width: int) -> torch.Tensor:
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width))
    values[0, :4] = torch.tensor([-0.0, 0.0, float("inf"), -float("inf")])
    values[-1, -3:] = torch.tensor([1e-45, -1e-45, float("nan")])
    return values


def _torch_path(monkeypatch):
    monkeypatch.setattr(_compressed, "_on_cpu", lambda *tensors: False)


@pytest.mark.parametrize("rows, width", [(1, 8), (2, 64), (4, 4096 * 8)])
def test_cpu_and_torch_paths_agree_bit_for_bit(monkeypatch, rows, width):
    values = _values(rows, width)
    error_cpu, error_torch = torch.randn(rows, width), None
    error_torch = error_cpu.clone()
    bits = values.signbit()
    outs = {}
    for name, error in (("cpu", error_cpu), ("torch", error_torch)):
        if name == "torch":
            _torch_path(monkeypatch)
        message = compress(values, error)
        outs[name] = (
            pack_signs(values),
            pack_bits(bits),
            unpack_bits(pack_bits(bits)),
            message,
            decompress(message).view(torch.int32),
        )
    for got, want in zip(outs["cpu"], outs["torch"]):
        assert torch.equal(got, want)
    assert torch.equal(error_cpu.view(torch.int32), error_torch.view(torch.int32))


def test_the_cpu_path_is_taken_on_cpu_tensors(monkeypatch):
    calls = []
    monkeypatch.setattr(_compressed.np, "packbits", lambda *a, **k: calls.append(1) or _packbits(*a, **k))
    compress(torch.randn(2, 16), torch.zeros(2, 16))
    assert calls


_packbits = _compressed.np.packbits
