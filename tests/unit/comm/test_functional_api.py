"""DeepSpeed's functional comm API without a process group: signatures, errors, env reads."""

import inspect
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

import shardwise.comm as dist
from shardwise.comm import _functional


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


_EMPTY = inspect.Parameter.empty


def test_signatures_follow_deepspeed():
    assert _params(dist.all_reduce) == [
        ("tensor", _EMPTY),
        ("op", dist.ReduceOp.SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_reduce"),
        ("debug", None),
    ]
    assert _params(dist.broadcast)[:4] == [("tensor", _EMPTY), ("src", _EMPTY), ("group", None), ("async_op", False)]
    assert _params(dist.barrier)[:3] == [("group", None), ("async_op", False), ("device_ids", None)]
    assert _params(dist.gather)[:5] == [
        ("tensor", _EMPTY),
        ("gather_list", None),
        ("dst", 0),
        ("group", None),
        ("async_op", False),
    ]
    assert _params(dist.recv)[:4] == [("tensor", _EMPTY), ("src", None), ("group", None), ("tag", 0)]
    assert _params(dist.all_to_all_single)[:6] == [
        ("output", _EMPTY),
        ("tensor", _EMPTY),
        ("output_split_sizes", None),
        ("input_split_sizes", None),
        ("group", None),
        ("async_op", False),
    ]
    assert _params(dist.get_global_rank) == [("group", None), ("group_rank", 0)]
    assert _params(dist.reduce_scatter_tensor)[5][0] == "prof"


def test_init_distributed_signature_matches_deepspeed():
    names = [name for name, _ in _params(dist.init_distributed)]
    assert names == [
        "dist_backend",
        "auto_mpi_discovery",
        "distributed_port",
        "verbose",
        "timeout",
        "init_method",
        "dist_init_required",
        "config",
        "rank",
        "world_size",
    ]
    defaults = dict(_params(dist.init_distributed))
    assert (defaults["distributed_port"], defaults["rank"], defaults["world_size"]) == (29500, -1, -1)
    assert isinstance(defaults["timeout"], timedelta)


@pytest.mark.parametrize(
    "fn",
    [
        dist.get_rank,
        dist.get_world_size,
        dist.get_local_rank,
        dist.get_world_group,
        dist.get_global_rank,
        dist.has_all_gather_into_tensor,
    ],
)
def test_rank_queries_before_init_raise_assertion_error_like_deepspeed(fn):
    assert not torch_dist.is_initialized()
    with pytest.raises(AssertionError, match="init_distributed"):
        fn()


def test_state_before_init():
    assert dist.is_initialized() is False
    assert dist.is_available() is True
    with pytest.raises(AssertionError, match="new_group"):
        dist.new_group([0])
    for collective in (
        lambda: dist.all_reduce(torch.ones(1)),
        lambda: dist.barrier(),
        lambda: dist.all_gather_object([None], 1),
        lambda: dist.broadcast_object_list([1], 0),
    ):
        with pytest.raises(ValueError, match="init"):
            collective()


def test_launcher_env(monkeypatch):
    for name in (
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    assert (
        dist.get_local_rank_from_launcher(),
        dist.get_world_rank_from_launcher(),
        dist.get_world_size_from_launcher(),
    ) == (0, 0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert (dist.get_local_rank_from_launcher(), dist.get_world_size_from_launcher()) == (2, 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "7")
    assert (dist.get_local_rank_from_launcher(), dist.get_world_rank_from_launcher()) == (3, 7)


def test_reduce_op_maps_to_torch():
    assert [op.name for op in dist.ReduceOp] == ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "UNUSED"]
    assert dist.ReduceOp.AVG.value == 7
    assert _functional._torch_op(dist.ReduceOp.SUM) == torch_dist.ReduceOp.SUM
    assert _functional._torch_op(dist.ReduceOp.AVG) == torch_dist.ReduceOp.AVG
    assert _functional._torch_op(dist.ReduceOp.BXOR) == torch_dist.ReduceOp.BXOR
    assert _functional._torch_op(torch_dist.ReduceOp.MAX) == torch_dist.ReduceOp.MAX
    with pytest.raises(ValueError, match="UNUSED"):
        _functional._torch_op(dist.ReduceOp.UNUSED)


def test_everything_exported_is_defined():
    for name in _functional.__all__:
        assert getattr(dist, name) is getattr(_functional, name)
    assert {"CollectiveError", "Communicator", "init_distributed"} <= set(dist.__all__)
