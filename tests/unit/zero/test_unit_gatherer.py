"""Stage 3's UnitGatherer in one process: a world of one whose all-gather copies the shard,
two Linear units, and the gather / free / prefetch / keep decisions read off the units'
states and the order of the all-gathers (no process group)."""

from types import SimpleNamespace

import torch
from torch import nn

from shardwise.zero._gatherer import UnitGatherer
from shardwise.zero._partition import partition
from shardwise.zero._strategy import no_timer
from shardwise.zero._unit import Stage3Unit, UnitState


class _Done:
    def wait(self) -> None:
        pass


class _WorldOfOne:
    """All-gather over one rank: the shard is the whole buffer. Records each tag."""

    rank, world_size = 0, 1

    def __init__(self):
        self.tags: list[str] = []

    def all_gather_into_tensor(self, out, shard, *, tag):
        self.tags.append(tag)
        out.copy_(shard)
        return _Done()


def _gatherer(**limits) -> tuple[UnitGatherer, nn.Sequential, nn.Sequential]:
    """Two Linear(2, 2) units laid out and freed, with a gatherer over them; returns it,
    the model and an untouched copy of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    reference = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    reference.load_state_dict(model.state_dict())
    strategy = SimpleNamespace(
        module=model,
        comm=_WorldOfOne(),
        timer=no_timer,
        swapper=None,
        offload=None,
        buckets=[],
        _ensure_layout=lambda: None,
    )
    gatherer = UnitGatherer(
        strategy,
        param_offload=None,
        prefetch_numel=limits.get("prefetch_numel", 10**9),
        max_live_numel=limits.get("max_live_numel", 10**9),
        max_reuse_distance=0,
    )
    for index, layer in enumerate(model):
        params = [layer.weight, layer.bias]
        padded, shard = partition(6, 1)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        for p, off, shape in zip(params, (0, 4), (layer.weight.shape, layer.bias.shape)):
            p.data = flat[off : off + shape.numel()].view(shape)
        unit = Stage3Unit(
            index,
            0,
            params,
            [0, 4],
            6,
            padded,
            shard,
            flat,
            shapes=[layer.weight.shape, layer.bias.shape],
            comm=strategy.comm,
            module=layer,
        )
        unit.master = nn.Parameter(flat.detach().clone())
        strategy.buckets.append(unit)
        gatherer.count_live(unit, +1)
        gatherer.add_user(layer, unit)
        gatherer.reshard(unit, force=True)
    return gatherer, model, reference


def _states(gatherer: UnitGatherer) -> list[UnitState]:
    return [unit.state for unit in gatherer.strategy.buckets]


def test_each_unit_is_gathered_for_its_forward_and_freed_after_it():
    gatherer, model, reference = _gatherer()
    seen = []
    model[1].register_forward_pre_hook(lambda module, args: seen.append(_states(gatherer)))
    x = torch.randn(3, 2)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert seen == [[UnitState.SHARDED, UnitState.GATHERED]]  # the first unit was freed before the second ran
    assert _states(gatherer) == [UnitState.SHARDED, UnitState.SHARDED]
    assert gatherer.live_numel == 0 and gatherer.peak_live_numel == 6
    assert gatherer.strategy.comm.tags == ["parameters of unit 0 (Linear)", "parameters of unit 1 (Linear)"]


def test_keep_gathered_keeps_every_unit_whole_until_the_block_ends():
    gatherer, model, _ = _gatherer()
    with gatherer.keep_gathered():
        with torch.no_grad():
            model(torch.randn(3, 2))
            model(torch.randn(3, 2))
        assert _states(gatherer) == [UnitState.GATHERED, UnitState.GATHERED]
    assert _states(gatherer) == [UnitState.SHARDED, UnitState.SHARDED]
    assert len(gatherer.strategy.comm.tags) == 2  # one gather per unit for both forwards


def test_after_the_first_step_a_forward_prefetches_the_next_unit_within_the_live_limit():
    gatherer, model, reference = _gatherer()
    model(torch.randn(3, 2)).sum().backward()
    gatherer.backward_done()  # the first step records the forward order
    gatherer.peak_live_numel = 0  # count the second forward only
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(_states(gatherer)))
    x = torch.randn(3, 2)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    # when unit 0's forward ends (and it is freed), unit 1's all-gather is already in flight
    assert seen == [[UnitState.SHARDED, UnitState.GATHERING]]
    assert gatherer.peak_live_numel == 12

    limited, model, _ = _gatherer(max_live_numel=6)
    model(torch.randn(3, 2)).sum().backward()
    limited.backward_done()
    limited.peak_live_numel = 0
    with torch.no_grad():
        model(torch.randn(3, 2))
    assert limited.peak_live_numel == 6  # stage3_max_live_parameters stops the prefetch


def test_backward_done_frees_what_is_left_and_forgets_the_calls():
    gatherer, model, _ = _gatherer()
    for unit in gatherer.strategy.buckets:
        gatherer.unshard(unit)
        unit.enter(0)
    gatherer.backward_done()
    assert _states(gatherer) == [UnitState.SHARDED, UnitState.SHARDED]
    assert [u.active for u in gatherer.strategy.buckets] == [0, 0] and gatherer.live_numel == 0
