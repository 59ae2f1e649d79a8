"""Host copies on the CPU (see [Note: host copies]): nothing to move, the same values, and
the source free to change once a copy to the device returns. The GPU side is exercised by
tests/gpu/test_offload_cuda.py."""

import torch

from shardwise.offload import HostCopies, copy_from_host_, to_device


def test_to_host_on_the_cpu_is_the_tensor_itself_and_done():
    tensor = torch.arange(6.0)
    pending = HostCopies(torch.device("cpu")).to_host(tensor)
    assert pending.done()
    assert pending.result() is tensor


def test_copy_from_host_casts_into_the_destination_and_leaves_the_source_free():
    src = torch.randn(10)
    dst = torch.zeros(10, dtype=torch.bfloat16)
    copy_from_host_(dst, src)
    expected = src.to(torch.bfloat16)
    src.zero_()
    assert torch.equal(dst, expected)


def test_to_device_reuses_a_tensor_already_there_and_casts_otherwise():
    src = torch.randn(4, 3)
    cpu = torch.device("cpu")
    assert to_device(src, cpu, torch.float32) is src
    cast = to_device(src, cpu, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and cast.shape == src.shape and torch.equal(cast, src.to(torch.bfloat16))
