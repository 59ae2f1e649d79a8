"""A stage-3 unit's state machine (see [Note: unit states] in ``zero/_unit.py``), driven by
hand: no process group, the all-gather replaced by a copy of the full values."""

from concurrent.futures import Future

import pytest
import torch
from torch import nn

from shardwise.zero._unit import Stage3Unit, UnitState


class _Gather:
    """Stands in for an all-gather: writes the full values, records its wait."""

    def __init__(self, full: torch.Tensor):
        self.full, self.waited = full, False

    def __call__(self, flat: torch.Tensor) -> "_Gather":
        flat.copy_(self.full)
        return self

    def wait(self) -> None:
        self.waited = True


def _unit(*, persistent: bool = False) -> tuple[Stage3Unit, torch.Tensor]:
    """A unit of a (2, 3) weight and a (4,) bias over 4 ranks, laid out whole, and its
    full padded values."""
    shapes = [torch.Size([2, 3]), torch.Size([4])]
    full = torch.cat([torch.arange(10.0), torch.zeros(2)])
    flat = full.clone()
    params = [nn.Parameter(flat[0:6].view(2, 3)), nn.Parameter(flat[6:10])]
    unit = Stage3Unit(0, 0, params, [0, 6], 10, 12, 3, flat, shapes=shapes, persistent=persistent)
    return unit, full


def _sharded() -> tuple[Stage3Unit, torch.Tensor]:
    unit, full = _unit()
    unit.free()
    return unit, full


def test_a_unit_is_laid_out_gathered_and_freeing_it_releases_the_storage_and_empties_the_parameters():
    unit, _ = _unit()
    assert unit.state is UnitState.GATHERED
    unit.free()
    assert unit.state is UnitState.SHARDED
    assert unit.flat_param.untyped_storage().nbytes() == 0
    assert [p.numel() for p in unit.params] == [0, 0]


def test_gathering_allocates_the_buffer_and_the_parameters_view_it_once_the_gather_finishes():
    unit, full = _sharded()
    gather = _Gather(full)
    unit.begin_gather(gather)
    assert unit.state is UnitState.GATHERING and unit.pending is gather
    assert unit.flat_param.untyped_storage().nbytes() == 12 * 4
    unit.finish_gather()
    assert unit.state is UnitState.GATHERED and gather.waited and unit.pending is None
    assert torch.equal(unit.params[0], torch.arange(6.0).view(2, 3))
    assert torch.equal(unit.params[1], torch.arange(6.0, 10.0))
    assert unit.params[1].data_ptr() == unit.flat_param[6:].data_ptr()


def test_a_swapped_shard_is_read_then_gathered():
    unit, full = _sharded()
    read: Future = Future()
    unit.begin_read(read)
    assert unit.state is UnitState.READING
    assert unit.flat_param.untyped_storage().nbytes() == 12 * 4
    read.set_result(full[3:6])
    assert torch.equal(unit.take_read(), full[3:6])
    assert unit.reading is None and unit.state is UnitState.READING
    unit.begin_gather(_Gather(full))
    unit.finish_gather()
    assert unit.state is UnitState.GATHERED


@pytest.mark.parametrize("begun", ["read", "gather"])
def test_freeing_a_unit_in_flight_completes_what_was_started(begun):
    unit, full = _sharded()
    if begun == "read":
        read: Future = Future()
        read.set_result(full[:3])
        unit.begin_read(read)
    else:
        gather = _Gather(full)
        unit.begin_gather(gather)
    unit.free()
    assert unit.state is UnitState.SHARDED and unit.reading is None and unit.pending is None
    assert unit.flat_param.untyped_storage().nbytes() == 0
    if begun == "gather":
        assert gather.waited


def test_illegal_transitions_raise_and_leave_the_state_alone():
    unit, full = _unit()
    cases = [
        (unit.begin_read, (Future(),)),
        (unit.begin_gather, (_Gather(full),)),
        (unit.finish_gather, ()),
        (unit.take_read, ()),
    ]
    for transition, args in cases:  # GATHERED: only free is allowed
        with pytest.raises(RuntimeError, match="stage 3 unit 0"):
            transition(*args)
        assert unit.state is UnitState.GATHERED
    unit.free()
    for transition, args in [(unit.free, ()), (unit.finish_gather, ()), (unit.take_read, ())]:
        with pytest.raises(RuntimeError, match="stage 3 unit 0"):
            transition(*args)
        assert unit.state is UnitState.SHARDED


def test_an_all_gather_cannot_start_before_the_read_is_taken():
    unit, full = _sharded()
    unit.begin_read(Future())
    with pytest.raises(RuntimeError, match="before its read is taken"):
        unit.begin_gather(_Gather(full))
    assert unit.state is UnitState.READING


def test_a_persistent_unit_is_never_freed():
    unit, _ = _unit(persistent=True)
    with pytest.raises(RuntimeError, match="persistent"):
        unit.free()
    assert unit.state is UnitState.GATHERED and unit.flat_param.untyped_storage().nbytes() == 12 * 4


def test_the_use_count_follows_nested_forward_calls():
    unit, _ = _unit()
    unit.enter(3)
    unit.enter(5)
    assert unit.active == 2
    assert unit.exit() == 5 and unit.active == 1
    assert unit.exit() == 3 and unit.active == 0
    with pytest.raises(RuntimeError, match="never entered"):
        unit.exit()
    unit.enter(7)
    unit.forget_calls()
    assert unit.active == 0 and unit.calls == []
