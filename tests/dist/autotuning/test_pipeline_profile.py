"""An autotuning experiment of a pipeline: ``train_batch`` on 2 stages is the step the
engine's profile window times (see [Note: autotuning experiment]); both ranks stop after
``end_profile_step`` and rank 0 writes the metrics and the parameter count of the whole
model (each stage holds half)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

import shardwise
from shardwise.pipe import PipelineModule
from shardwise.testing import run_distributed
from shardwise.testing.models import pipeline_specs

V, H = 32, 16


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def _profiled(rank, world_size, *, folder):
    model = PipelineModule(pipeline_specs(4, tied=False, vocab=V, width=H), num_stages=2, loss_fn=_loss)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"stages": 2},
        "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 3,
                       "metric_path": f"{folder}/metrics.json", "model_info_path": f"{folder}/model_info.json"},
    }  # fmt: skip
    engine, *_ = shardwise.initialize(model=model, config=config)
    batches = 0
    try:
        for _ in range(10):
            engine.train_batch(iter([(torch.randint(0, V, (2, 6)), torch.randint(0, V, (2, 6)))] * 2))
            batches += 1
    except SystemExit as exc:
        return {"batches": batches, "code": exc.code, "local_params": sum(p.numel() for p in model.parameters())}
    return {"batches": batches, "code": None}


def test_pipeline_train_batch_is_profiled(tmp_path):
    reports = run_distributed(_profiled, world_size=2, tmp_path=tmp_path, folder=str(tmp_path))
    # steps 1..3 ran (the window is steps 2..3); the 4th train_batch ended at its step
    assert [(r["batches"], r["code"]) for r in reports] == [(3, 0), (3, 0)]
    metrics = json.loads(Path(tmp_path / "metrics.json").read_text())
    assert metrics["num_steps"] == 2 and metrics["train_batch_size"] == 4 and metrics["throughput"] > 0
    info = json.loads(Path(tmp_path / "model_info.json").read_text())
    assert info["num_params"] == 2 * reports[0]["local_params"]  # rank 0's stage, scaled by the 2 stages
