"""Tensor-parallel pieces without a process group: a group of one rank is the PyTorch layer
and issues no collective; the shard rule, the marks, the group argument and the refusals
of sizes that do not split evenly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import Communicator
from shardwise.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    as_tensor_comm,
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
    shard_info,
    vocab_parallel_cross_entropy,
)


class _StandIn(Communicator):
    """A tensor group's Communicator without a process group: it records collectives and
    performs none (the layers are only constructed, or run with one rank)."""

    def __init__(self, world_size: int = 1, rank: int = 0):
        self.world_size, self.rank, self.name = world_size, rank, "tensor-parallel"
        self.issued: list[str] = []

    def all_reduce(self, tensor, *, op=None, tag=""):
        self.issued.append(tag)
        assert self.world_size == 1, "a stand-in cannot reduce over several ranks"
        return _Done()

    def all_gather_into_tensor(self, output, input, *, tag=""):
        raise AssertionError(f"unexpected all-gather {tag}")

    def reduce_scatter_tensor(self, output, input, *, op=None, tag=""):
        raise AssertionError(f"unexpected reduce-scatter {tag}")


class _Done:
    def wait(self):
        pass


MAPPINGS = [
    copy_to_tensor_region,
    reduce_from_tensor_region,
    scatter_to_tensor_region,
    gather_from_tensor_region,
    scatter_to_sequence_region,
    gather_from_sequence_region,
    reduce_scatter_to_sequence_region,
]


@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda f: f.__name__)
def test_one_rank_mapping_is_identity_without_collectives(mapping):
    comm = _StandIn()
    x = torch.randn(4, 3, 6, requires_grad=True)
    y = mapping(x, comm)
    assert y is x
    (y * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert comm.issued == []


def test_one_rank_layers_equal_pytorch_layers_with_the_same_seed():
    comm = _StandIn()
    x = torch.randn(5, 2, 8)
    torch.manual_seed(3)
    column = ColumnParallelLinear(8, 12, group=comm)
    row = RowParallelLinear(12, 8, group=comm)
    embedding = VocabParallelEmbedding(10, 8, group=comm, padding_idx=1)
    torch.manual_seed(3)
    ref_column, ref_row, ref_embedding = nn.Linear(8, 12), nn.Linear(12, 8), nn.Embedding(10, 8, padding_idx=1)
    for got, want in ((column, ref_column), (row, ref_row), (embedding, ref_embedding)):
        for (name, p), q in zip(got.named_parameters(), want.parameters()):
            assert torch.equal(p, q), name
    torch.testing.assert_close(row(column(x)), ref_row(ref_column(x)))
    ids = torch.tensor([[0, 1, 9], [4, 1, 2]])
    torch.testing.assert_close(embedding(ids), ref_embedding(ids))
    norm = SequenceParallelLayerNorm(8, group=comm)
    torch.testing.assert_close(norm(x), nn.LayerNorm(8)(x))
    assert comm.issued == []


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_one_rank_cross_entropy_matches_torch(label_smoothing):
    logits = (torch.randn(3, 4, 11) * 5).requires_grad_()
    target = torch.randint(0, 11, (3, 4))
    loss = vocab_parallel_cross_entropy(logits, target, _StandIn(), label_smoothing)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(
        ref_logits.view(-1, 11), target.view(-1), reduction="none", label_smoothing=label_smoothing
    ).view(3, 4)
    torch.testing.assert_close(loss, ref)
    weights = torch.rand(3, 4)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_shards_are_slices_of_the_seeded_full_layer_and_carry_their_place():
    comm = _StandIn(world_size=4, rank=2)
    torch.manual_seed(0)
    column = ColumnParallelLinear(8, 16, gather_output=False, group=comm)
    row = RowParallelLinear(16, 8, input_is_parallel=True, group=comm)
    embedding = VocabParallelEmbedding(20, 8, group=comm)
    torch.manual_seed(0)
    full_column, full_row, full_embedding = nn.Linear(8, 16), nn.Linear(16, 8), nn.Embedding(20, 8)

    assert torch.equal(column.weight, full_column.weight[8:12]) and torch.equal(column.bias, full_column.bias[8:12])
    assert torch.equal(row.weight, full_row.weight[:, 8:12]) and torch.equal(row.bias, full_row.bias)
    assert torch.equal(embedding.weight, full_embedding.weight[10:15])
    assert (embedding.vocab_start, embedding.vocab_end) == (10, 15)
    for param, full_shape, dim in (
        (column.weight, (16, 8), 0),
        (column.bias, (16,), 0),
        (row.weight, (8, 16), 1),
        (embedding.weight, (20, 8), 0),
    ):
        assert (param.tensor_model_parallel, param.partition_dim, param.partition_stride) == (True, dim, 1)
        assert param.tensor_parallel_full_shape == full_shape
        assert shard_info(param) == (torch.Size(full_shape), dim, 2, 4)
    assert shard_info(row.bias) is None and not hasattr(row.bias, "tensor_model_parallel")

    twin = copy.deepcopy(column)
    assert twin.comm is comm and shard_info(twin.weight) == shard_info(column.weight)
    assert twin.weight is not column.weight and torch.equal(twin.weight, column.weight)


def test_from_linear_and_from_conv1d_take_this_ranks_slice():
    comm = _StandIn(world_size=2, rank=1)
    linear = nn.Linear(6, 4)
    conv = nn.Module()  # Hugging Face's GPT-2 Conv1D stores the weight as [in, out]
    conv.weight, conv.bias = nn.Parameter(linear.weight.detach().t().clone()), nn.Parameter(linear.bias.detach())
    for build in (ColumnParallelLinear.from_linear, ColumnParallelLinear.from_conv1d):
        layer = build(linear if build.__name__ == "from_linear" else conv, group=comm)
        assert torch.equal(layer.weight, linear.weight[2:]) and torch.equal(layer.bias, linear.bias[2:])
        assert not layer.gather_output and layer.weight.requires_grad
    for build in (RowParallelLinear.from_linear, RowParallelLinear.from_conv1d):
        layer = build(linear if build.__name__ == "from_linear" else conv, group=comm)
        assert torch.equal(layer.weight, linear.weight[:, 3:]) and torch.equal(layer.bias, linear.bias)
        assert layer.input_is_parallel
    assert linear.weight.shape == (4, 6)  # the full layer is left as it was
    frozen = nn.Embedding(6, 3, padding_idx=5).requires_grad_(False)
    embedding = VocabParallelEmbedding.from_embedding(frozen, group=comm)
    assert torch.equal(embedding.weight, frozen.weight[3:]) and not embedding.weight.requires_grad
    assert embedding.padding_idx == 5


def test_sizes_that_do_not_split_evenly_are_refused():
    comm = _StandIn(world_size=4)
    with pytest.raises(ValueError, match=r"output_size=10 is not divisible by the tensor-parallel degree .* 4"):
        ColumnParallelLinear.from_linear(nn.Linear(8, 10), group=comm)
    with pytest.raises(ValueError, match=r"input_size=6 is not divisible by the tensor-parallel degree .* 4"):
        RowParallelLinear.from_linear(nn.Linear(6, 8), group=comm)
    with pytest.raises(ValueError, match=r"num_embeddings=10 is not divisible"):
        VocabParallelEmbedding(10, 4, group=comm)
    with pytest.raises(ValueError, match=r"dim 2 length=6 is not divisible .* 4"):
        scatter_to_tensor_region(torch.zeros(2, 3, 6), comm)


def test_inconsistent_options_are_refused():
    comm = _StandIn(world_size=2)
    with pytest.raises(ValueError, match="gather_output=False"):
        ColumnParallelLinear(4, 4, group=comm, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_is_parallel=True"):
        RowParallelLinear(4, 4, group=comm, sequence_parallel=True)
    with pytest.raises(ValueError, match="padding_idx=7"):
        VocabParallelEmbedding(4, 2, group=comm, padding_idx=7)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), comm, 1.0)


def test_meta_device_allocates_nothing_and_keeps_the_marks():
    layer = ColumnParallelLinear(8, 16, group=_StandIn(world_size=2, rank=1), device="meta")
    assert layer.weight.is_meta and layer.weight.shape == (8, 8)
    assert shard_info(layer.weight) == (torch.Size([16, 8]), 0, 1, 2)


def test_group_argument_forms():
    comm = _StandIn()
    grid = type("Grid", (), {"tensor_comm": comm})()
    mpu = type("Mpu", (), {"get_tensor_model_parallel_group": lambda self: comm})()
    deepspeed_mpu = type("Mpu", (), {"get_model_parallel_group": lambda self: comm})()
    for group in (comm, grid, mpu, deepspeed_mpu):
        assert as_tensor_comm(group) is comm
    with pytest.raises(ValueError, match="pass group=: the tensor-parallel process group, a Communicator, or the grid"):
        as_tensor_comm(None)
    with pytest.raises(ValueError, match=r"get_model_parallel_group\(\) returned None"):
        as_tensor_comm(type("Mpu", (), {"get_model_parallel_group": lambda self: None})())
    with pytest.raises(TypeError, match="got str"):
        ColumnParallelLinear(4, 4, group="tp")
