"""The engine's side of an autotuning experiment (see [Note: autotuning experiment]): the
measured window's metrics (FLOPs included) written, then a clean exit at that step; without
``metric_path`` the file DeepSpeed's engine writes."""

import json

import pytest
import torch
from torch import nn

import shardwise


def _engine(tmp_path, **tuning):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, **tuning},
    }
    torch.manual_seed(0)
    engine, _, _, _ = shardwise.initialize(model=nn.Linear(4, 2), config=config)
    return engine


def _train(engine, steps):
    for _ in range(steps):
        loss = engine(torch.randn(2, 4)).square().mean()
        engine.backward(loss)
        engine.step()


def test_writes_the_window_metrics_and_exits_after_end_profile_step(tmp_path):
    path = tmp_path / "exp" / "metrics.json"
    engine = _engine(tmp_path, metric_path=str(path), metric="flops")
    with pytest.raises(SystemExit) as stop:
        _train(engine, 10)
    assert stop.value.code == 0
    assert engine.global_steps == 4  # the exit comes during the fifth step, before its update
    metrics = json.loads(path.read_text())
    assert metrics["num_steps"] == 3 and metrics["train_batch_size"] == 2
    assert metrics["throughput"] == pytest.approx(2 * 3 / metrics["elapsed_s"])
    assert metrics["latency"] == pytest.approx(1000 * metrics["elapsed_s"] / 3)
    # one iteration of Linear(4, 2) on 2 samples: the forward's addmm and the weight
    # gradient's mm, 2 * 2 * 4 * 2 FLOPs each (the input needs no gradient)
    assert metrics["flops_per_step"] == 64
    assert metrics["flops"] == pytest.approx(64 * 3 / metrics["elapsed_s"])


def test_without_metric_path_the_metrics_go_to_the_working_directory(tmp_path, monkeypatch):
    # DeepSpeed's engine: autotuning_metric.json in the working directory, then exit; a
    # window that starts at step 1 has no iteration before it: the one after it is counted
    monkeypatch.chdir(tmp_path)
    engine = _engine(tmp_path, start_profile_step=1, end_profile_step=1, metric="flops")
    with pytest.raises(SystemExit):
        _train(engine, 7)
    assert engine.global_steps == 2
    metrics = json.loads((tmp_path / "autotuning_metric.json").read_text())
    assert metrics["num_steps"] == 1 and metrics["flops_per_step"] == 64


@pytest.mark.parametrize("path", ["model_info.json", None])
def test_model_info_run_writes_the_parameter_count_and_exits(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)  # DeepSpeed's default: autotuning_model_info.json there
    with pytest.raises(SystemExit):
        _engine(tmp_path, model_info={"profile": True}, **({"model_info_path": path} if path else {}))
    written = tmp_path / (path or "autotuning_model_info.json")
    assert json.loads(written.read_text()) == {"num_params": 10, "trainable_num_params": 10}
