"""Stage 3 limits: live parameters, reuse distance and persistence do what their keys say."""

import copy

import torch
from torch import nn

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.parity import max_param_diff

LAYERS, WIDTH, MICRO = 6, 16, 2
UNIT = WIDTH * WIDTH + WIDTH  # one Linear's weight and bias (a multiple of 2 ranks: no padding)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x - y).square().mean()


def _run(rank, world_size, knobs, steps=3):
    model = _Stack()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(MICRO * world_size, WIDTH, generator=generator),
            torch.randn(MICRO * world_size, WIDTH, generator=generator),
        )
        for _ in range(steps)
    ]
    for x, y in data:
        reference(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, **knobs},
        },
    )
    gathers = []
    for x, y in data:
        before = engine.comm.calls["all_gather"]
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(x[mine], y[mine]))
        engine.step()
        gathers.append(engine.comm.calls["all_gather"] - before)
    whole = sorted(n for n, p in engine.module.named_parameters() if p.numel() > 0)
    return {
        "peak": engine.strategy.peak_live_numel,
        "gathers": gathers,
        "whole": whole,
        "diff": max_param_diff(reference, engine.module),
    }


def _all(rank, world_size):
    partition = {"stage3_param_persistence_threshold": 0}
    return {
        "one at a time": _run(
            rank, world_size, {**partition, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}
        ),
        "live cap": _run(
            rank,
            world_size,
            {**partition, "stage3_max_live_parameters": 3 * UNIT, "stage3_prefetch_bucket_size": 10**6},
        ),
        "no reuse": _run(rank, world_size, {**partition, "stage3_max_reuse_distance": 0}),
        "reuse": _run(rank, world_size, {**partition, "stage3_max_reuse_distance": 10**9}),
        "persist biases": _run(rank, world_size, {"stage3_param_persistence_threshold": WIDTH + 1}),
    }


def test_stage3_limits(tmp_path):
    for out in run_distributed(_all, world_size=2, tmp_path=tmp_path):
        for name, result in out.items():
            assert result["diff"] < 1e-6, name  # every setting trains exactly like PyTorch
        # nothing prefetched or kept: one unit in use, and the next one's backward gather
        # may start while the current one's gradients are being copied out
        assert out["one at a time"]["peak"] <= 2 * UNIT
        # prefetch stops at the cap; the unit in use is gathered regardless of it
        assert out["live cap"]["peak"] <= 3 * UNIT + UNIT
        assert out["live cap"]["peak"] > 2 * UNIT  # the cap, not a lack of prefetch, bounds it
        # reuse keeps each layer from its forward to its backward: backward gathers nothing;
        # without it only the last layer is kept (its backward follows at distance 0)
        assert out["no reuse"]["gathers"][1:] == [2 * LAYERS - 1, 2 * LAYERS - 1]
        assert out["reuse"]["gathers"][1:] == [LAYERS, LAYERS]
        assert out["reuse"]["peak"] == LAYERS * UNIT
        # parameters under the threshold stay whole on every rank; the rest is partitioned
        assert out["persist biases"]["whole"] == [f"layers.{i}.bias" for i in range(LAYERS)]
        assert out["no reuse"]["whole"] == []
