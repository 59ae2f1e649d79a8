"""Splitting experts over the tensor group (``moe/_expert_tp.py``): which linear layers are
column- and row-parallel, what is refused and why, the slices a tensor rank keeps, and the
shares of rows the tensor ranks move (their layout is a permutation of the whole)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.moe._expert_tp import share_layout, shares, split_expert, split_plan
from shardwise.moe.layer import MoE
from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
        self.w2 = nn.Linear(12, 8, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FusedGateUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 24), nn.Linear(12, 8)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x) + x)


def _mlp(hidden=12):
    return nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 8))


def test_the_first_linears_are_column_parallel_and_the_last_row_parallel():
    assert split_plan(_mlp(), 2, where="e") == {"0": "column", "2": "row"}
    assert split_plan(SwiGLU(), 4, where="e") == {"w1": "column", "w3": "column", "w2": "row"}
    residual = nn.Sequential(nn.Dropout(0.0), nn.Linear(8, 12), nn.ReLU(), nn.Dropout(0.0), nn.Linear(12, 8))
    assert split_plan(residual, 2, where="e") == {"1": "column", "4": "row"}


@pytest.mark.parametrize(
    "expert, message",
    [
        (_mlp(7), "e: 0.out_features=7 (the expert's hidden size) is not divisible by the tensor-parallel size 2"),
        (FusedGateUp(), "its call of chunk (a method) splits features a tensor rank holds a slice of"),
        (Mixed(), "its call of add mixes whole and split features"),
        (nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 8)), "its module '1' (LayerNorm) is not"),
        (nn.Sequential(nn.Linear(8, 12), nn.GELU()), "the expert's output is not whole features"),
        (nn.Linear(8, 8), "its tensor 'weight' used outside an nn.Linear"),
    ],
)
def test_experts_that_cannot_be_split_are_refused_with_the_fix(expert, message):
    with pytest.raises(ValueError, match="enable_expert_tensor_parallelism False") as info:
        split_plan(expert, 2, where="e")
    assert message in str(info.value)


def _fake_comm(rank, size=2):
    comm = SimpleNamespace(world_size=size, rank=rank)
    comm.tensor_comm = comm  # what as_tensor_comm reads from a grid
    return comm


def test_a_tensor_rank_keeps_its_slice_and_the_expert_marks():
    torch.manual_seed(0)
    full = _mlp()
    for p in full.parameters():
        p.allreduce, p.group_name = False, "ep_size_2"
    expert = nn.Sequential(*list(full))  # the same modules: split_expert replaces them in place
    replaced = split_expert(expert, _fake_comm(1), where="e")
    column, row = expert[0], expert[2]
    assert isinstance(column, ColumnParallelLinear) and isinstance(row, RowParallelLinear)
    assert torch.equal(column.weight, full[0].weight[6:]) and torch.equal(column.bias, full[0].bias[6:])
    assert torch.equal(row.weight, full[2].weight[:, 6:]) and torch.equal(row.bias, full[2].bias)
    assert replaced == {
        full[0].weight: column.weight,
        full[0].bias: column.bias,
        full[2].weight: row.weight,
        full[2].bias: row.bias,
    }
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in expert.parameters())
    assert split_expert(expert, _fake_comm(1), where="e") == {}  # already split: taken as it is
    with pytest.raises(ValueError, match="split over 2 ranks .* the grid's tensor group over 4"):
        split_expert(expert, _fake_comm(1, 4), where="e")


def test_without_a_tensor_group_the_flag_changes_nothing():
    moe = MoE(8, _mlp(), num_experts=2, enable_expert_tensor_parallelism=True)
    before = [p.clone() for p in moe.parameters()]
    for tensor_comm in (None, _fake_comm(0, 1)):
        assert moe.bind(SimpleNamespace(ep_comm=None), tensor_comm) == {}
    assert all(isinstance(e[0], nn.Linear) for e in moe.deepspeed_moe.experts.deepspeed_experts)
    assert moe.deepspeed_moe.tensor_comm is None
    assert all(torch.equal(a, b) for a, b in zip(before, moe.parameters()))


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0], [7], [1, 1, 1, 1, 1]])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_shares_cover_every_row_once_and_each_group_stays_together(counts, parts):
    counts = torch.tensor(counts)
    share = shares(counts, parts)
    assert torch.equal(share.sum(0), counts)
    assert int(share.sum(1).max() - share.sum(1).min()) <= 1  # the ranks' totals evened out
    place, sizes = share_layout(share)
    assert sizes == share.sum(1).tolist()
    assert torch.equal(place.sort().values, torch.arange(int(counts.sum())))
    # rank-major concatenation (rank, group, row): each row lands inside its group's range
    ends = counts.cumsum(0)
    group = torch.arange(len(counts)).repeat(parts).repeat_interleave(share.reshape(-1))
    assert torch.all((place < ends[group]) & (place >= ends[group] - counts[group]))


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0], [2, 7]])
def test_every_rank_rebuilds_the_whole_from_the_shares(counts):
    """Each tensor rank takes its share of the whole rows; the all-gather of the shares
    (padded to the largest) gives every rank the whole rows back, in their order."""
    from shardwise.moe._expert_tp import _Shares

    parts, counts = 3, torch.tensor(counts)
    share = shares(counts, parts)
    whole = torch.randn(int(counts.sum()), 2)
    layouts = [_Shares.of(share, _fake_comm(u, parts), "cpu") for u in range(parts)]
    taken = [whole.index_select(0, layout.own) for layout in layouts]
    assert torch.equal(torch.cat(taken).sort(0).values, whole.sort(0).values)  # each row in one share

    def all_gather_into_tensor(out, padded, tag):
        most = padded.shape[0]
        for u, piece in enumerate(taken):
            out[u * most : (u + 1) * most] = 0
            out[u * most : u * most + piece.shape[0]] = piece
        return SimpleNamespace(wait=lambda: None)

    for layout, piece in zip(layouts, taken):
        layout.comm.all_gather_into_tensor = all_gather_into_tensor
        assert torch.equal(layout.gather(piece, "test"), whole)
