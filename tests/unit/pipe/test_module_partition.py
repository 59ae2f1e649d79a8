"""PipelineModule's partitioning arithmetic, its profiled layer costs and LayerSpec, without
processes."""

import itertools
import random
from functools import partial

import pytest
import torch
from torch import nn

from shardwise.pipe import LayerSpec, PipelineError, TiedLayerSpec, _profile
from shardwise.pipe._partition import partition_min_max
from shardwise.pipe.module import _param_count, _type_name, partition_balanced, partition_uniform


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


@pytest.mark.parametrize(
    "weights, parts, expected",
    [  # DeepSpeed 0.19.8's deepspeed.runtime.utils.partition_balanced on the same weights
        ([3, 1, 4, 1, 5, 9, 2, 6], 3, [0, 5, 6, 8]),
        ([1, 1, 1, 1, 1, 1, 0, 0], 5, [0, 2, 3, 4, 5, 8]),
        ([3, 5, 1, 3, 9, 3, 3, 2, 8, 7, 1], 5, [0, 4, 5, 8, 9, 11]),
        ([1, 0, 0, 1, 0, 1, 0, 0, 1], 2, [0, 5, 9]),
        ([5, 1, 1, 1, 1, 1, 1, 5], 3, [0, 2, 7, 8]),
    ],
)
def test_balanced_partition_gives_deepspeeds_boundaries(weights, parts, expected):
    # the most even split, not only the lightest heaviest stage: the first case's
    # [0, 5, 7, 8] is as light (14) but less even (14 | 11 | 6 against 14 | 9 | 8)
    assert partition_balanced(weights, parts) == expected


def _heaviest(weights, bounds):
    return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_min_max_partition_makes_the_slowest_stage_as_fast_as_it_can_be():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(2, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random(), rng.randint(1, 9)]) for _ in range(n)]
        bounds = partition_min_max(costs, parts)
        assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n
        assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds  # every stage has a layer
        best = min(_heaviest(costs, (0, *cuts, n)) for cuts in itertools.combinations(range(1, n), parts - 1))
        assert _heaviest(costs, bounds) == best, (costs, parts, bounds)
    # the head + loss outweighs the blocks: the first stage takes more layers
    assert partition_min_max([1.0, 2.0, 2.0, 2.0, 2.0, 5.0], 2) == [0, 4, 6]
    assert partition_min_max([6, 1, 1, 6], 2) == [0, 2, 4]  # 7 | 7, not 6 | 8 or 8 | 6


@pytest.mark.parametrize("bad", [[1.0, -1.0], [1.0, float("nan")], [float("inf"), 1.0]])
def test_partitions_refuse_bad_weights(bad):
    for partition in (partition_balanced, partition_min_max):
        with pytest.raises(PipelineError, match="finite non-negative"):
            partition(bad, 2)


def test_type_names_skip_callables_without_one():
    # DeepSpeed's "type:" counts a plain callable only by its __name__
    assert _type_name(partial(torch.tanh)) is None
    assert _type_name(torch.tanh) == "tanh" and _type_name(LayerSpec(nn.ReLU)) == "ReLU"


class _Clock:
    """A stand-in for ``time.perf_counter`` that layers advance by their cost."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _Costly(nn.Module):
    """A linear layer costing ``forward`` fake seconds forward and ``backward`` backward; it
    counts its forwards in a buffer (as a BatchNorm updates its running statistics)."""

    def __init__(self, clock, forward, backward):
        super().__init__()
        self.clock, self.costs = clock, (forward, backward)
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.clock.now += self.costs[0]
        self.calls += 1
        out = self.linear(x)
        out.register_hook(self._charge_backward)
        return out

    def _charge_backward(self, grad):
        self.clock.now += self.costs[1]


def test_profiled_costs_time_each_layer_and_leave_no_trace(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_profile, "time", clock)
    given = _Costly(clock, 1.0, 2.0)  # a module passed built: its grads and buffers are the user's
    before = {k: v.clone() for k, v in given.state_dict().items()}
    specs = [given, LayerSpec(_Costly, clock, 3.0, 5.0), lambda x: x * 2, LayerSpec(_Costly, clock, 0.5, 0.25)]
    built = []

    def build(i):
        spec = specs[i]
        built.append(i)
        return spec.build() if isinstance(spec, LayerSpec) else spec

    def loss_fn(out, labels):
        clock.now += 10.0
        return ((out - labels) ** 2).mean()

    torch.manual_seed(0)
    expected_draw = torch.rand(1)
    torch.manual_seed(0)
    sample = (torch.randn(3, 4), torch.randn(3, 4))
    torch.manual_seed(0)
    costs = _profile.layer_costs(build, len(specs), sample, loss_fn=loss_fn)
    # each layer's forward + backward on its own; the loss with the last layer
    assert costs == [3.0, 8.0, 0.0, 10.75]
    assert built == [0, 1, 2, 3]
    assert torch.equal(torch.rand(1), expected_draw)  # the random state is as it was
    assert all(p.grad is None for p in given.parameters())
    after = given.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the buffer too
    with pytest.raises(PipelineError, match="an \\(inputs, labels\\) pair"):
        _profile.check_sample(torch.zeros(2))


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
