"""Activation checkpointing across a tensor-parallel group of 2 ranks: partitioned inputs
give the un-checkpointed gradients while each rank keeps 1/tp of the bytes (with host
memory and contiguous buffers too), and the model-parallel seed gives per-rank dropout
inside ``fork()`` and the same dropout outside. One spawn checks every case by name."""

import torch
import torch.distributed as dist
from torch import nn

from shardwise import checkpointing
from shardwise.comm import Communicator
from shardwise.runtime.activation_checkpointing._settings import SETTINGS
from shardwise.testing import run_distributed

TP = 2


class _Mpu:
    """The part of Megatron's mpu that deepspeed.checkpointing reads."""

    def __init__(self, group):
        self.group = group

    def get_tensor_model_parallel_group(self):
        return self.group

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank(self.group)

    def get_tensor_model_parallel_world_size(self):
        return dist.get_world_size(self.group)


class _CopyToTp(torch.autograd.Function):
    """Identity forward, gradient summed over the tensor group (Megatron's copy_to region)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad).wait()
        return grad, None


class _ReduceFromTp(torch.autograd.Function):
    """Sum over the tensor group forward, identity backward (Megatron's reduce_from region)."""

    @staticmethod
    def forward(ctx, x, comm):
        x = x.clone()
        comm.all_reduce(x).wait()
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _TpLayer(nn.Module):
    """A tensor-parallel MLP block as Megatron writes it: each rank holds half the hidden
    units, dropout on them draws inside the tracker's fork (per rank), dropout on the
    all-reduced output outside it (the same on every rank), so the output is replicated."""

    def __init__(self, width, comm):
        super().__init__()
        full_up, full_down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)  # same on every rank
        rows = slice(comm.rank * width, (comm.rank + 1) * width)
        self.up_w, self.up_b = nn.Parameter(full_up.weight[rows].detach()), nn.Parameter(full_up.bias[rows].detach())
        self.down_w, self.down_b = nn.Parameter(full_down.weight[:, rows].detach()), full_down.bias
        self.comm, self.drop = comm, nn.Dropout(0.3)

    def forward(self, x, mask):
        h = torch.tanh(nn.functional.linear(_CopyToTp.apply(x, self.comm), self.up_w, self.up_b))
        with checkpointing.get_cuda_rng_tracker().fork():
            h = self.drop(h)
        y = self.drop(_ReduceFromTp.apply(nn.functional.linear(h, self.down_w), self.comm) + self.down_b)
        return x + y * mask


def _run(layers, x, mask, *, checkpointed):
    """Two layers on a replicated input; returns grads, the bytes saved for backward and
    the saved tensors' storages."""
    for layer in layers:
        layer.zero_grad()
    x = x.detach().requires_grad_()
    checkpointing.model_parallel_cuda_manual_seed(11)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for layer in layers:
            h = checkpointing.checkpoint(layer, h, mask) if checkpointed else layer(h, mask)
    (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()] + [x.grad.clone()]
    nbytes = sum(t.numel() * t.element_size() for t in saved if t.is_floating_point())
    return grads, nbytes, saved


def _same(a, b):
    return all(torch.allclose(u, v, rtol=1e-6, atol=1e-7) for u, v in zip(a, b))


def _check_partitioned_checkpointing(rank, world_size):
    group = dist.new_group(list(range(TP)))
    mpu, comm = _Mpu(group), Communicator(group, name="test-tensor-parallel")
    torch.manual_seed(0)  # the same full weights and input on both tensor ranks
    layers = [_TpLayer(16, comm), _TpLayer(16, comm)]
    x, mask = torch.randn(4, 16), torch.ones(4, 1, dtype=torch.int64)
    report = {}

    checkpointing.configure(mpu)
    reference, _, _ = _run(layers, x, mask, checkpointed=False)
    plain, plain_bytes, _ = _run(layers, x, mask, checkpointed=True)
    report["plain checkpoint matches"] = _same(plain, reference)

    checkpointing.configure(mpu, partition_activations=True)
    grads, nbytes, saved = _run(layers, x, mask, checkpointed=True)
    report["partitioned matches"] = _same(grads, reference)
    report["partitioned bytes are 1/tp"] = (nbytes * TP == plain_bytes, nbytes, plain_bytes)
    report["mask kept whole"] = any(t is mask for t in saved)
    report["one all-gather per partitioned input"] = SETTINGS.tensor_comm.calls["all_gather"] == 2

    checkpointing.configure(
        mpu, deepspeed_config={"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    )
    grads, nbytes, saved = _run(layers, x, mask, checkpointed=True)
    floats = [t for t in saved if t.is_floating_point()]
    report["partitioned in host memory matches"] = _same(grads, reference) and nbytes * TP == plain_bytes
    report["slices on the host"] = all(t.device.type == "cpu" for t in floats)

    odd = [_TpLayer(5, comm)]  # inputs of 15 and 5 elements: slices of 8 and 3, the last rank's padded
    for shape in ((3, 5), (1, 5)):
        torch.manual_seed(1)
        xo = torch.randn(shape)
        checkpointing.configure(mpu)
        want, _, _ = _run(odd, xo, 1, checkpointed=False)
        checkpointing.configure(mpu, partition_activations=True)
        got, got_bytes, _ = _run(odd, xo, 1, checkpointed=True)
        report[f"padded {shape} matches"] = _same(got, want) and got_bytes == 4 * -(-xo.numel() // TP)

    checkpointing.configure(mpu, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    grads, nbytes, saved = _run(layers, x, mask, checkpointed=True)
    slices = [t for t in saved if t.is_floating_point()]
    report["contiguous matches"] = _same(grads, reference) and nbytes * TP == plain_bytes
    report["contiguous slots share one buffer"] = (
        len({t.untyped_storage().data_ptr() for t in slices}) == 1 and slices[1].data_ptr() > slices[0].data_ptr()
    )
    h = x.clone().requires_grad_()
    for layer in layers:
        h = checkpointing.checkpoint(layer, h, mask)
    try:
        checkpointing.checkpoint(layers[0], h, mask)
        report["third checkpoint refused"] = False
    except RuntimeError as exc:
        report["third checkpoint refused"] = "number_checkpoints=2" in str(exc)
    checkpointing.reset()  # the forward above had no backward
    grads, _, _ = _run(layers, x, mask, checkpointed=True)
    report["contiguous after reset matches"] = _same(grads, reference)

    checkpointing.configure(mpu)
    checkpointing.model_parallel_cuda_manual_seed(5)
    outside = torch.rand(8)
    with checkpointing.get_cuda_rng_tracker().fork():
        inside = torch.rand(8)
    return report, outside, inside


def test_partitioned_activations_on_a_tensor_group_of_two(tmp_path):
    results = run_distributed(_check_partitioned_checkpointing, world_size=TP, tmp_path=tmp_path)
    for rank, (report, _, _) in enumerate(results):
        failed = {
            name: value
            for name, value in report.items()
            if value is not True and not (isinstance(value, tuple) and value[0] is True)
        }
        assert not failed, f"rank {rank}: {failed}"
    (_, out0, in0), (_, out1, in1) = results
    assert torch.equal(out0, out1), "dropout outside fork() must agree across tensor ranks"
    assert not torch.equal(in0, in1), "dropout inside fork() must differ across tensor ranks"
