"""``optimizer.overflow`` says whether the last fp16 step was skipped, and only the last.

Hugging Face Trainer and Accelerate read it (Accelerate as ``step_was_skipped``) before
stepping their learning-rate scheduler, so a flag left set after one overflow would freeze
the learning rate for the rest of the run. One forced infinite loss (on rank 0 only: every
rank skips), then an ordinary step: the flag reads exactly False, True, False.
"""

import importlib.util
import os

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 1000,
    "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
}


def _loss(rank, step, loss):
    return loss * float("inf") if step == 0 and rank == 0 else loss


def _through_the_engine(rank):
    engine, optimizer, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=CONFIG)
    flags, applied = [optimizer.overflow], []
    for step, (tokens, targets) in enumerate(token_batches(num_steps=2, batch=2, seed=rank)):
        engine.backward(_loss(rank, step, engine(tokens, targets)))
        engine.step()
        flags.append(optimizer.overflow)
        applied.append(engine.was_step_applied())
    return flags, applied


def _through_accelerate(rank, world_size):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    shardwise.install_as_deepspeed()  # before Accelerate is imported
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    config = {key: value for key, value in CONFIG.items() if key != "optimizer"}
    config["zero_optimization"] = {"stage": 0}
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]
    )
    model = TinyMLP(seed=1)
    batches = token_batches(num_steps=2, batch=2, seed=rank)
    engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    flags = [optimizer.step_was_skipped]
    for step, (tokens, targets) in enumerate(batches):
        accelerator.backward(_loss(rank, step, engine(tokens, targets)))
        optimizer.step()
        optimizer.zero_grad()
        flags.append(optimizer.step_was_skipped)
    return flags, engine.fp16_enabled(), engine.get_loss_scale()


def _both(rank, world_size):
    return _through_the_engine(rank), _through_accelerate(rank, world_size)


def test_the_overflow_flag_is_set_by_a_skipped_step_and_cleared_by_the_next_applied_one(tmp_path):
    for (flags, applied), (accelerate_flags, fp16, scale) in run_distributed(
        _both, world_size=2, tmp_path=tmp_path, timeout_s=180, fresh_processes=True
    ):
        assert applied == [False, True]
        assert flags == [False, True, False]
        assert all(type(flag) is bool for flag in flags)
        assert fp16 and scale == 2**7  # Accelerate ran the fp16 engine, which skipped once
        assert accelerate_flags == [False, True, False]
        assert all(type(flag) is bool for flag in accelerate_flags)
