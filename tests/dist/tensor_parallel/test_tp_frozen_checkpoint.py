"""``save_checkpoint(exclude_frozen_parameters=True)`` under tensor parallelism
(``tensor_parallel.autotp_size`` 2 on 2 ranks, ZeRO 1, SGD with momentum): the Llama of
``test_tp_checkpoint`` with two frozen split linears (``gate_proj``, split by rows, and
``o_proj``, split by columns) leaves them out of the checkpoint (no file names them); a
model built with the same frozen weights and scrambled trainable ones loads it, and its
next step equals, bit for bit, the step of the run that never saved."""

from pathlib import Path

import torch
from test_tp_checkpoint import _batches, _config, _model, _train

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.checkpoints import stored_tensor_names

FROZEN = ("model.layers.0.mlp.gate_proj.", "model.layers.0.self_attn.o_proj.")


def _frozen_model(scramble: bool):
    model = _model("llama")
    layer = model.model.layers[0]
    layer.mlp.gate_proj.requires_grad_(False)
    layer.self_attn.o_proj.requires_grad_(False)
    if scramble:
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.mul_(-2.0)
    return model


def _engine(scramble: bool):
    engine, *_ = shardwise.initialize(model=_frozen_model(scramble), config=_config(1, "fp32", 2))
    return engine


def _save_and_resume(rank, world_size, checkpoint_dir):
    batches = _batches()  # one step before the save, one after
    engine = _engine(scramble=False)
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _train(engine, batches[:1])
    engine.save_checkpoint(checkpoint_dir, tag="t", exclude_frozen_parameters=True)
    _train(engine, batches[1:])
    resumed = _engine(scramble=True)
    resumed.load_checkpoint(checkpoint_dir, tag="t")
    _train(resumed, batches[1:])
    want = dict(engine.module.named_parameters())
    diff = {n: (p - want[n]).abs().max().item() for n, p in resumed.module.named_parameters()}
    moved = max((want[n] - start[n]).abs().max().item() for n in start)
    return diff, moved, stored_tensor_names(Path(checkpoint_dir) / "t")


def test_tensor_parallel_checkpoint_leaves_frozen_split_linears_out(tmp_path):
    reports = run_distributed(_save_and_resume, world_size=2, tmp_path=tmp_path, checkpoint_dir=str(tmp_path))
    names = reports[0][2]
    assert not [n for n in names if n.startswith(FROZEN)], f"frozen tensors saved: {names}"
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"} <= set(names), names
    for rank, (diff, moved, _) in enumerate(reports):
        assert moved > 1e-3, f"rank {rank}: training did not move the weights ({moved})"
        assert max(diff.values()) == 0.0, f"rank {rank}: resumed off by {diff}"
