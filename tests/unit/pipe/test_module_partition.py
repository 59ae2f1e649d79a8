"""PipelineModule's partitioning arithmetic and LayerSpec, without processes."""

import pytest
from torch import nn

from shardwise.pipe import LayerSpec, PipelineError, TiedLayerSpec
from shardwise.pipe.module import _param_count, partition_balanced, partition_uniform


def test_uniform_partition_spreads_the_remainder_first():
    assert partition_uniform(10, 3) == [0, 4, 7, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "weights, parts, expected",
    [
        ([1] * 8, 2, [0, 4, 8]),
        ([10, 1, 1, 1, 1, 1, 1, 1], 2, [0, 1, 8]),
        ([0, 5, 5, 5, 5, 0], 4, [0, 2, 3, 4, 6]),
        ([3, 3, 3], 3, [0, 1, 2, 3]),
    ],
)
def test_balanced_partition_minimises_the_heaviest_stage(weights, parts, expected):
    assert partition_balanced(weights, parts) == expected


def test_balanced_partition_gives_every_stage_a_layer():
    bounds = partition_balanced([100, 0, 0, 0], 4)
    assert bounds == [0, 1, 2, 3, 4]
    with pytest.raises(PipelineError, match="cannot fill 3 pipeline stages"):
        partition_balanced([1, 1], 3)


def test_layer_specs_count_parameters_without_allocating():
    spec = LayerSpec(nn.Linear, 1000, 1000)
    assert _param_count(spec) == 1000 * 1000 + 1000
    assert repr(spec) == "Linear(1000, 1000)"
    tied = TiedLayerSpec("embed", nn.Embedding, 10, 4, tied_weight_attr="weight")
    assert tied.key == "embed" and tied.tied_weight_attr == ["weight"]
    with pytest.raises(PipelineError, match="needs an nn.Module class"):
        LayerSpec(lambda: None)
