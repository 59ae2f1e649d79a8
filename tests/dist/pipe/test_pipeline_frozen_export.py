"""``save_16bit_model`` and ``module_state_dict`` with ``exclude_frozen_parameters=True`` on 2
pipeline stages, a frozen layer on each: the one file (``torch.save`` and safetensors) and
every rank's whole-model state dict hold every stage's trainable layers, as trained, and no
stage's frozen one (each stage names only its own; see [Note: frozen parameters of other
ranks] in ``runtime/_full_state.py``)."""

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import shardwise
from shardwise.testing import run_distributed

MICRO = 2
TRAINED = ["1.bias", "1.weight", "3.bias", "3.weight"]


def _pipeline():
    from shardwise.pipe import PipelineModule

    torch.manual_seed(6)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)]
    for frozen in (layers[0], layers[2]):  # a frozen base on each stage
        frozen.requires_grad_(False)
    return PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")


def _export(rank, world_size, save_dir):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    generator = torch.Generator().manual_seed(7)
    data = [(torch.randn(MICRO, 8, generator=generator), torch.randn(MICRO, 4, generator=generator)) for _ in range(2)]
    engine, *_ = shardwise.initialize(model=_pipeline(), config=config)
    engine.train_batch(iter(data))
    everything = engine.module_state_dict()
    files = {}
    for name in ("pytorch_model.bin", "model.safetensors"):
        engine.save_16bit_model(save_dir, name, exclude_frozen_parameters=True)
        path = str(Path(save_dir) / name)
        files[name] = load_file(path) if name.endswith(".safetensors") else torch.load(path, weights_only=True)
    trained = engine.module_state_dict(exclude_frozen_parameters=True)
    out = {"module_state_dict": trained, **files}
    return {what: {k: torch.equal(v, everything[k]) for k, v in state.items()} for what, state in out.items()}


def test_16bit_file_and_state_dict_leave_every_stages_frozen_layers_out(tmp_path):
    reports = run_distributed(_export, world_size=2, tmp_path=tmp_path, save_dir=str(tmp_path))
    for rank, report in enumerate(reports):
        for what, same in report.items():
            assert sorted(same) == TRAINED, f"rank {rank}: {what} holds {sorted(same)}, want {TRAINED}"
            assert all(same.values()), f"rank {rank}: {what} differs from the trained weights: {same}"
