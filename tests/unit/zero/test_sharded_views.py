"""The state and checkpoint views of the stage-1/2 layout, seen from each rank of a world
of two simulated in one process: a communicator that knows its rank and whose
collectives leave other ranks' slices as they are (every simulated rank holds the same
values, so that is what a real all-gather would give). No process group."""

import pytest
import torch
from torch import nn

from shardwise.precision import PrecisionPolicy
from shardwise.zero import ShardedStrategy
from shardwise.zero._strategy import MASTER_KEY, PARAM_KEY, ShardBlock


class _Done:
    def wait(self) -> None:
        pass


class _OneRankOfTwo:
    world_size = 2

    def __init__(self, rank: int):
        self.rank = rank

    def broadcast(self, tensor, *, src, tag):
        return _Done()

    def all_gather_scratch(self, tensor, *, tag):
        return _Done()

    def all_reduce(self, tensor, *, tag):
        return _Done()


def _strategy(rank: int) -> tuple[ShardedStrategy, nn.Sequential]:
    """Stage 2 over Linear(3, 2) + Linear(2, 1): 11 elements in one bucket, padded to 12,
    6 per rank, with an Adam optimizer over the shards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    strategy = ShardedStrategy(model, comm=_OneRankOfTwo(rank), policy=PrecisionPolicy(), stage=2, bucket_numel=1000)
    strategy.adopt_client_optimizer(torch.optim.Adam(strategy.optimizer_params(model.parameters()), lr=0.1))
    return strategy, model


# reverse registration order: the order backward produces the gradients
NAMES = ("1.bias", "1.weight", "0.bias", "0.weight")
SHAPES = (torch.Size([1]), torch.Size([1, 2]), torch.Size([2]), torch.Size([2, 3]))


def _flat(model: nn.Module) -> torch.Tensor:
    """The model's parameters laid out as the bucket lays them, padding included."""
    params = dict(model.named_parameters())
    return torch.cat([params[n].detach().reshape(-1) for n in NAMES] + [torch.zeros(1)])


@pytest.mark.parametrize("rank", [0, 1])
def test_module_blocks_and_shards_are_the_ranks_range_of_the_flat_layout(rank):
    strategy, model = _strategy(rank)
    assert strategy.views.module_state_blocks() == [ShardBlock(0, PARAM_KEY, torch.float32, NAMES, SHAPES, 12, 6)]
    with strategy.views.module_shards(0) as shards:
        assert torch.equal(shards[PARAM_KEY], _flat(model)[rank * 6 : (rank + 1) * 6])


def test_each_parameter_element_is_in_exactly_one_ranks_local_state():
    strategies = [_strategy(rank)[0] for rank in (0, 1)]
    for name, param in strategies[0].module.named_parameters():
        parts = [s.views.local_param_state(dict(s.module.named_parameters())[name], MASTER_KEY) for s in strategies]
        assert torch.equal(torch.cat(parts), param.detach().reshape(-1)), name


@pytest.mark.parametrize("rank", [0, 1])
def test_a_named_optimizer_state_loads_as_this_ranks_slice(rank):
    strategy, model = _strategy(rank)
    strategy.step(max_grad_norm=0.0, loss_scale=1.0)  # creates exp_avg / exp_avg_sq (zero gradients)
    blocks = strategy.views.optimizer_state_blocks()
    assert [(b.key, b.names, b.padded, b.shard) for b in blocks] == [
        ("exp_avg", NAMES, 12, 6),
        ("exp_avg_sq", NAMES, 12, 6),
    ]
    full = {n: torch.arange(float(s.numel())).view(s) + 10 * i for i, (n, s) in enumerate(zip(NAMES, SHAPES))}
    saved = strategy.views.optimizer_state_replicated()
    saved["state"] = {
        n: {"step": saved["state"][n]["step"], "exp_avg": full[n], "exp_avg_sq": 2 * full[n]} for n in NAMES
    }
    strategy.views.load_optimizer_state_by_name(saved)
    flat = torch.cat([full[n].reshape(-1) for n in NAMES] + [torch.zeros(1)])
    with strategy.views.optimizer_shards(0) as shards:
        assert torch.equal(shards["exp_avg"], flat[rank * 6 : (rank + 1) * 6])
        assert torch.equal(shards["exp_avg_sq"], 2 * flat[rank * 6 : (rank + 1) * 6])
