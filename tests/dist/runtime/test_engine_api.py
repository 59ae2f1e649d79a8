"""Engine API behaviours a DeepSpeed user relies on, and its refusals."""

import logging

import pytest
import torch

import shardwise
from shardwise.config import ConfigError
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches

BASE = {
    "gradient_clipping": 0.0,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


def _expect_error(exc_type, fn):
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"expected {exc_type.__name__}")


def _api(rank, world_size):
    out = {}
    out["lamb_zero"] = _expect_error(
        NotImplementedError,
        lambda: shardwise.initialize(
            model=TinyMLP(), config={**BASE, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}}
        ),
    )
    out["offload"] = _expect_error(
        ConfigError,
        lambda: shardwise.initialize(
            model=TinyMLP(), config={**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
        ),
    )
    out["offload_stage0"] = _expect_error(
        ConfigError,
        lambda: shardwise.initialize(
            model=TinyMLP(), config={**BASE, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
        ),
    )
    out["grad_accum"] = _expect_error(
        NotImplementedError,
        lambda: shardwise.initialize(
            model=TinyMLP(), config={**BASE, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
        ),
    )
    out["two_optimizers"] = _expect_error(
        ValueError,
        lambda: shardwise.initialize(
            model=TinyMLP(), optimizer=torch.optim.SGD(TinyMLP().parameters(), lr=0.1), config=BASE
        ),
    )
    out["no_config"] = _expect_error(ValueError, lambda: shardwise.initialize(model=TinyMLP()))
    out["bad_batch"] = _expect_error(
        ConfigError, lambda: shardwise.initialize(model=TinyMLP(), config={**BASE, "train_batch_size": 7})
    )

    # the batch triangle uses the real world size
    engine, optimizer, loader, scheduler = shardwise.initialize(
        model=TinyMLP(),
        config={
            **BASE,
            "train_batch_size": 4 * world_size,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.4, "warmup_type": "linear"},
            },
        },
    )
    out["gas"] = engine.gradient_accumulation_steps()
    out["returned"] = (optimizer is engine.optimizer, loader is None, scheduler is engine.lr_scheduler)
    tokens, targets = token_batches(num_steps=1, batch=2, seed=rank)[0]
    lrs, boundaries = [], []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(tokens, targets))
        engine.step()
        lrs.append(engine.get_lr()[0])
    out["lrs"], out["boundaries"] = lrs, boundaries
    out["norm"] = engine.get_global_grad_norm()
    out["applied"] = engine.was_step_applied()
    out["state_bytes"] = engine.model_state_bytes()

    # a client optimizer and a client scheduler factory
    model = TinyMLP()
    engine, optimizer, _, scheduler = shardwise.initialize(
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        config={"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 2},
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    engine.backward(engine(tokens, targets))
    engine.step()
    out["client"] = (type(optimizer).__name__, type(scheduler).__name__, engine.get_lr())

    # the data loader shards the dataset across ranks
    dataset = torch.utils.data.TensorDataset(torch.arange(40.0))
    loader = engine.deepspeed_io(dataset)
    out["shard"] = sorted(int(v) for (batch,) in loader for v in batch)
    return out


def test_engine_api(tmp_path):
    results = run_distributed(_api, world_size=2, tmp_path=tmp_path)
    out = results[0]
    assert "Lamb optimizer needs whole parameters" in out["lamb_zero"]
    assert 'offload_param.device="nvme" needs offload_optimizer.device "nvme"' in out["offload"]
    assert "offload_optimizer needs stage 1, 2 or 3" in out["offload_stage0"]
    assert "keep only one of them" in out["two_optimizers"]
    assert "data_types.grad_accum_dtype='fp32' differs from the training dtype" in out["grad_accum"]
    assert "no config" in out["no_config"]
    assert "train_batch_size (7) is not divisible" in out["bad_batch"]
    assert out["gas"] == 2
    assert out["returned"] == (True, True, True)
    assert out["boundaries"] == [False, True, False, True]
    # WarmupLR linear over 4 steps: lr = 0.4 * last_batch_iteration / 4, where the scheduler
    # steps after each optimizer step (every 2nd micro-step): -1 (start), 0, then 1
    assert out["lrs"] == pytest.approx([0.0, 0.0, 0.0, 0.1])
    assert out["norm"] > 0 and out["applied"]
    state = out["state_bytes"]
    n_params = sum(p.numel() for p in TinyMLP().parameters())
    assert state.params == state.grads == 4 * n_params
    assert state.optimizer_state == 2 * 4 * n_params + 4 * len(list(TinyMLP().parameters()))
    assert state.master_params == 0
    assert out["client"][0:2] == ("SGD", "StepLR")
    assert out["client"][2] == [0.25]
    shards = [r["shard"] for r in results]
    assert len(shards[0]) == len(shards[1]) == 20
    assert sorted(shards[0] + shards[1]) == list(range(40))


def _progress(rank, world_size):
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("shardwise").addHandler(Capture())
    engine, _, _, _ = shardwise.initialize(
        model=TinyMLP(), config={**BASE, "steps_per_print": 2, "fp16": {"enabled": True}, "wall_clock_breakdown": True}
    )
    tokens, targets = token_batches(num_steps=1, batch=2, seed=rank)[0]
    for _ in range(4):
        engine.backward(engine(tokens, targets))
        engine.step()
    return [r for r in records if r.startswith("step ")]


def test_progress_lines_on_rank0_only(tmp_path):
    lines = run_distributed(_progress, world_size=2, tmp_path=tmp_path)
    assert lines[1] == []
    assert len(lines[0]) == 2
    for line in lines[0]:
        for part in ("loss ", "lr ", "loss scale ", "samples/s", "forward ", "backward "):
            assert part in line, line
