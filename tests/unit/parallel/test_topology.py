"""The process topology's arithmetic, DeepSpeed's semantics, without processes."""

import pytest

from shardwise.parallel import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from shardwise.parallel.grid import _sizes_of


def test_last_axis_is_innermost():
    topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert [topo.get_rank(x=0, y=y) for y in range(3)] == [0, 1, 2]
    assert topo.get_rank(x=1, y=0) == 3
    assert topo.get_coord(4) == topo.ProcessCoord(x=1, y=1)
    assert topo.get_coord(5).y == 2
    assert topo.world_size() == 6
    assert topo.get_axis_names() == ["x", "y"]


def test_3d_groups_put_tensor_ranks_together():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("tensor") == []
    assert topo.filter_match(pipe=1, model=0) == [4, 6]
    assert topo.get_axis_list("pipe", 0) == [0, 1, 2, 3]
    assert topo.get_axis_list("data", 1) == [2, 3, 6, 7]
    assert topo.get_dim("model") == 2 and topo.get_dim("nonexistent") == 0
    assert topo.get_rank_repr(rank=3) == "model_01"
    assert topo.get_rank_repr(rank=6, omit_axes=["model"]) == "pipe_01-data_01"


def test_pipe_data_topology():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert _sizes_of(topo) == {"pipe": 2, "data": 3, "tensor": 1}


def test_grid_sizes_accept_model_or_tensor_axis():
    assert _sizes_of(PipeModelDataParallelTopology(1, 4, 2)) == {"pipe": 1, "data": 2, "tensor": 4}
    assert _sizes_of(ProcessTopology(["data", "tensor"], [2, 2])) == {"pipe": 1, "data": 2, "tensor": 2}


@pytest.mark.parametrize(
    "axes, dims, match",
    [
        (["x", "y"], [2], "one size per axis"),
        (["x", "x"], [2, 2], "unique"),
        (["x"], [0], "size >= 1"),
    ],
)
def test_bad_topologies_are_named(axes, dims, match):
    with pytest.raises(ValueError, match=match):
        ProcessTopology(axes, dims)


def test_grid_refuses_other_layouts():
    with pytest.raises(ValueError, match="not in the order pipe, data, tensor"):
        _sizes_of(ProcessTopology(["tensor", "data"], [2, 2]))
    with pytest.raises(ValueError, match=r"\['row'\] are not among them"):
        _sizes_of(ProcessTopology(["row", "data"], [2, 2]))
    with pytest.raises(ValueError, match="both 'tensor' and 'model'"):
        _sizes_of(ProcessTopology(["data", "model", "tensor"], [1, 2, 2]))


def test_get_rank_errors():
    topo = ProcessTopology(["a", "b"], [2, 2])
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(a=0)
    with pytest.raises(ValueError, match="outside"):
        topo.get_rank(a=2, b=0)
    with pytest.raises(ValueError, match="unknown axes"):
        topo.filter_match(c=0)
