"""Monitors record what the training loop saw: on 2 ranks with fp16, TensorBoard event files
(read back with TensorBoard's reader), CSV files and an offline W&B run hold rank 0's loss of
every optimizer step at x = samples seen, the learning rate, the loss scale, the wall-clock
timers, the memory figures and the user's own events; only rank 0 writes. The
flops_profiler section profiles its step through the same engine."""

import csv
import os
from pathlib import Path

import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.wandb_offline import offline_history

MICRO, GAS, STEPS = 2, 2, 4
TIMER_TAGS = [
    f"Train/Samples/elapsed_time_ms_{name}"
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step")
]
MEMORY_TAGS = [f"Train/Samples/memory_{name}_MB" for name in ("allocated", "max_allocated", "host_rss", "model_states")]


def _train(rank, world_size, out):
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(out / "wandb"), WANDB_SILENT="true")
    (out / "wandb").mkdir(exist_ok=True)
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": 2},
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "tensorboard": {"enabled": True, "output_path": str(out / "tb"), "job_name": "run"},
        "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "run"},
        "wandb": {"enabled": True, "project": "shardwise-test"},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(out / "flops.txt")},
        "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]},
    }
    model = TinyMLP(seed=1)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    seen = []
    for tokens, targets in token_batches(num_steps=STEPS, batch=MICRO * GAS * world_size, seed=2):
        losses = []
        for micro in range(GAS):
            start = (micro * world_size + rank) * MICRO
            loss = engine(tokens[start : start + MICRO], targets[start : start + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        seen.append((engine.global_samples, sum(losses) / GAS, engine.get_lr()[0], engine.get_loss_scale()))
    engine.monitor.write_events([("Custom/accuracy", 0.5, 7), ("Custom/accuracy", 0.5, 7)])  # twice: harmless
    built = [type(m).__name__ for m in engine.monitor.monitors]
    engine.monitor.close()
    logged = {
        op: sum(record["count"] for record in sizes.values())
        for op, sizes in shardwise.comm.log_summary(return_dict=True)["summary"].items()
    }
    shardwise.comm.configure(enabled=False)
    return seen, built, logged, dict(engine.comm.calls)


def _tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(Path(log_dir).glob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return files, {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_monitors_record_what_training_saw(tmp_path):
    (seen, built, logged, calls), (_, built_elsewhere, *_) = run_distributed(
        _train, world_size=2, tmp_path=tmp_path, out=tmp_path
    )
    assert sorted(built) == ["TensorBoardMonitor", "WandbMonitor", "csvMonitor"] and built_elsewhere == []
    samples = [s for s, *_ in seen]
    assert samples == [MICRO * GAS * 2 * (i + 1) for i in range(STEPS)]

    files, scalars = _tensorboard(tmp_path / "tb" / "run")
    assert len(files) == 1  # rank 0's only
    for tag, column in (("Train/Samples/train_loss", 1), ("Train/Samples/lr", 2), ("Train/Samples/loss_scale", 3)):
        got = scalars[tag]
        assert [s for s, _ in got] == samples, tag
        torch.testing.assert_close([v for _, v in got], [row[column] for row in seen], rtol=1e-6, atol=0, msg=tag)
    assert len({v for _, v in scalars["Train/Samples/train_loss"]}) == STEPS  # each step's own loss
    for tag in TIMER_TAGS + MEMORY_TAGS:
        assert [s for s, _ in scalars[tag]] == samples, tag
    assert all(v > 0 for _, v in scalars["Train/Samples/elapsed_time_ms_forward"])
    assert all(v > 0 for _, v in scalars["Train/Samples/memory_model_states_MB"])
    assert scalars["Custom/accuracy"] == [(7, 0.5), (7, 0.5)]

    with open(tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["step", "train_loss"]
    assert [int(s) for s, _ in rows[1:]] == samples
    torch.testing.assert_close([float(v) for _, v in rows[1:]], [row[1] for row in seen], rtol=1e-6, atol=0)
    assert {p.name for p in (tmp_path / "csv" / "run").iterdir()} >= {"Train_Samples_lr.csv", "Custom_accuracy.csv"}

    history = [row for row in offline_history(tmp_path / "wandb") if "Train/Samples/train_loss" in row]
    assert [row["_step"] for row in history] == samples
    torch.testing.assert_close(
        [row["Train/Samples/train_loss"] for row in history], [row[1] for row in seen], rtol=1e-6, atol=0
    )
    assert all(tag in history[0] for tag in TIMER_TAGS + ["Train/Samples/lr", "Train/Samples/loss_scale"])

    # comms_logger: the engine's data-parallel all-reduces (ZeRO-2 on gloo reduces gradients
    # with all-reduce: see comm/_collectives.py), and no other op under prof_ops
    assert set(logged) == {"all_reduce"} and logged["all_reduce"] >= calls["all_reduce"] > 0, (logged, calls)

    profile = (tmp_path / "flops.txt").read_text()  # the flops_profiler section, written by rank 0
    assert "Profile Summary at step 1" in profile and "params per GPU:" in profile
    assert "fwd flops per GPU:" in profile and "bwd flops per GPU:" in profile


def _pipeline_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1))


def _pipeline(rank, world_size, out):
    from shardwise.pipe import PipelineModule
    from shardwise.testing.models import pipeline_specs

    model = PipelineModule(
        pipeline_specs(2, tied=False, vocab=32, width=16),
        num_stages=2,
        loss_fn=_pipeline_loss,
        partition_method="uniform",
    )
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "pipe"},
        "wall_clock_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(out / "flops.txt")},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        micro = [
            (torch.randint(0, 32, (2, 6), generator=generator), torch.randint(0, 32, (2, 6), generator=generator))
            for _ in range(2)
        ]
        losses.append(float(engine.train_batch(iter(micro))))
    return losses, engine.global_samples


def test_pipeline_engine_logs_the_batch_loss(tmp_path):
    """Under pp2 the monitor (built on global rank 0, a first stage) logs every batch's loss,
    the mean over its micro-batches that train_batch returns on every rank, and the step
    timer; the flops_profiler step is printed."""
    (losses, samples), (losses_last, _) = run_distributed(_pipeline, world_size=2, tmp_path=tmp_path, out=tmp_path)
    assert losses == losses_last
    with open(tmp_path / "pipe" / "Train_Samples_train_loss.csv") as file:
        rows = list(csv.reader(file))[1:]
    assert [int(s) for s, _ in rows] == [4, 8, 12] and samples == 12
    torch.testing.assert_close([float(v) for _, v in rows], losses, rtol=1e-6, atol=0)
    timed = {p.name for p in (tmp_path / "pipe").iterdir()}
    assert {
        f"Train_Samples_elapsed_time_ms_{name}.csv" for name in ("step", "pipe_send_output", "pipe_recv_grad")
    } <= timed, timed  # rank 0 is stage 0: it sends activations and receives gradients
    profile = (tmp_path / "flops.txt").read_text()  # rank 0's stage, the profiled batch's first micro-batch
    assert "Profile Summary at step 1" in profile
    # one micro-batch of stage 0 (embedding, one 16x16 block on 2x6 tokens): 2*12*16*16 forward
    # flops, twice that backward, although 1F1B runs both forwards before the first backward
    lines = {line.split(":")[0]: line.split(":", 1)[1].split() for line in profile.splitlines() if ":" in line}
    assert lines["fwd flops per GPU"] == ["6.14", "K"] and lines["bwd flops per GPU"] == ["12.29", "K"], profile


def _zero3_offload(rank, world_size, out):
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(out / "nvme")},
        },
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "z3"},
    }
    model = TinyMLP(seed=1)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    for tokens, targets in token_batches(num_steps=2, batch=2 * world_size, seed=2):
        engine.backward(engine(tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]))
        engine.step()
    return engine.global_samples


def test_zero3_gathers_and_optimizer_swaps_are_timed(tmp_path):
    """With wall_clock_breakdown, ZeRO-3's waits for parameter all-gathers and the
    optimizer offload's waits for swap-file reads and writes are timers of their own,
    written for every step under DeepSpeed's names where DeepSpeed has one."""
    (tmp_path / "nvme").mkdir()
    samples = run_distributed(_zero3_offload, world_size=2, tmp_path=tmp_path, out=tmp_path)[0]
    for name in ("gather_params", "optimizer_swap_in_state", "optimizer_swap_out_state", "forward", "step"):
        with open(tmp_path / "z3" / f"Train_Samples_elapsed_time_ms_{name}.csv") as file:
            rows = list(csv.reader(file))[1:]
        assert [int(s) for s, _ in rows] == [4, 8] == [samples // 2, samples], name
        assert all(float(v) > 0 for _, v in rows), (name, rows)


def test_a_profile_step_never_reached_is_named_at_exit(tmp_path):
    """A world of one trains 2 steps with flops_profiler.profile_step 50: a warning at exit."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import shardwise
        from shardwise.testing.models import TinyMLP, token_batches
        model = TinyMLP(seed=1)
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "flops_profiler": {"enabled": True, "profile_step": 50}})
        for x, y in token_batches(num_steps=2, batch=2):
            engine.backward(engine(x, y))
            engine.step()
    """)
    )
    env = {**os.environ, "SHARDWISE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "flops_profiler.profile_step=50 was never reached: the run ended after 2 optimizer steps" in done.stderr
