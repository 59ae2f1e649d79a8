"""Ranks that run different modules fail fast with an error naming the collective and module."""

import time

import pytest
import torch

import shardwise
from shardwise.testing import DistributedTestError, run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL

DEADLINE_S = 2
"""comm.timeout_s, which rank 0 waits out once in the diverged gather. It bounds the first
step's collectives too, which the ranks reach together (milliseconds apart for this model),
with room for a loaded machine."""


def _diverge(rank, world_size):
    engine, _, _, _ = shardwise.initialize(
        model=TinyMLP(seed=1),
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
            "comm": {"timeout_s": DEADLINE_S},
            "steps_per_print": 1000,
        },
    )
    tokens, targets = token_batches(num_steps=1, batch=2, seed=rank)[0]
    engine.backward(engine(tokens, targets))
    engine.step()
    # a module that holds a tied weight can be called on its own, outside the model's forward
    assert tuple(engine.module.embed(tokens).shape) == (2, tokens.shape[1], 16)
    if rank == 1:  # a data-dependent branch that only rank 1 takes
        engine.module.fc2(engine.module.fc1(torch.randn(2, 16)))
    engine(tokens, targets)


def test_diverged_module_call_names_the_unit(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_diverge, world_size=2, tmp_path=tmp_path)
    message = str(info.value)
    assert time.monotonic() - start < 90
    assert "CollectiveError" in message
    assert "all_gather" in message and "(Linear)]" in message
