"""``save_checkpoint(exclude_frozen_parameters=True)`` with experts split over 2 ranks
(``ep_size`` 2, ZeRO 2, AdamW): a frozen dense layer beside the MoE layer (``inp``) and one
frozen expert (global id 3, rank 1's local expert 1) are left out of the checkpoint (no
file names them, experts being stored by global id); a model built with the same frozen
weights and scrambled trainable ones loads it, and its next step equals, bit for bit, the
step of the run that never saved. ``save_16bit_model`` and ``module_state_dict`` with
``exclude_frozen_parameters=True`` give every expert by global id but the frozen one, on
every rank (each rank names its own frozen experts by local id)."""

from pathlib import Path

import torch
from moe_common import expert_rank_model, make_batches, make_reference, moe_config, moe_loss
from safetensors.torch import load_file

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.checkpoints import stored_tensor_names

K, DROP = 2, False
FROZEN_EXPERT = 3
"""Global id; with 4 experts over 2 ranks it is rank 1's local expert 1."""
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts."


def _model(reference, rank):
    model = expert_rank_model(reference, 2, rank, K, DROP)
    model.inp.requires_grad_(False)
    if rank == FROZEN_EXPERT // 2:
        model.moe.deepspeed_moe.experts.deepspeed_experts[FROZEN_EXPERT % 2].requires_grad_(False)
    return model


def _engine(model):
    engine, *_ = shardwise.initialize(model=model, config=moe_config(2, "adamw", 0.0, "fp32"))
    return engine


def _step(engine, batch, rank) -> float:
    x, y = batch
    loss = moe_loss(engine, x[rank], y[rank])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_and_resume(rank, world_size, checkpoint_dir):
    reference = make_reference(K, DROP)
    batches = make_batches(world_size)
    engine = _engine(_model(reference, rank))
    for batch in batches[:2]:
        _step(engine, batch, rank)
    engine.save_checkpoint(checkpoint_dir, tag="t", exclude_frozen_parameters=True)
    engine.save_16bit_model(checkpoint_dir, "trained.safetensors", exclude_frozen_parameters=True)
    exported = {
        "16-bit file": sorted(load_file(str(Path(checkpoint_dir) / "trained.safetensors"))),
        "module_state_dict": sorted(engine.module_state_dict(exclude_frozen_parameters=True)),
    }
    went_on = _step(engine, batches[2], rank)
    fresh = _model(reference, rank)
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.mul_(-2.0)
    resumed = _engine(fresh)
    resumed.load_checkpoint(checkpoint_dir, tag="t")
    loss = _step(resumed, batches[2], rank)
    want = dict(engine.module.named_parameters())
    diff = {n: (p - want[n]).abs().max().item() for n, p in resumed.module.named_parameters()}
    moved = (want["out.weight"] - reference.out.weight).abs().max().item()
    return loss - went_on, diff, moved, stored_tensor_names(Path(checkpoint_dir) / "t"), exported


def test_moe_checkpoint_leaves_frozen_expert_and_dense_layer_out(tmp_path):
    reports = run_distributed(_save_and_resume, world_size=2, tmp_path=tmp_path, checkpoint_dir=str(tmp_path))
    names = reports[0][3]
    frozen = [n for n in names if n.startswith(("inp.", f"{EXPERT}{FROZEN_EXPERT}."))]
    assert not frozen, f"frozen tensors saved: {frozen}"
    for expert in range(FROZEN_EXPERT):  # the trainable experts, by global id, and the trainable dense layers
        assert f"{EXPERT}{expert}.0.weight" in names, f"expert {expert} missing: {names}"
    assert {"out.weight", "moe.deepspeed_moe.gate.wg.weight"} <= set(names), names
    frozen_prefixes = ("inp.", f"{EXPERT}{FROZEN_EXPERT}.")
    trained = sorted(n for n in make_reference(K, DROP).state_dict() if not n.startswith(frozen_prefixes))
    for rank, (loss, diff, moved, _, exported) in enumerate(reports):
        for what, keys in exported.items():
            assert keys == trained, f"rank {rank}: {what} holds {keys}, want {trained}"
        assert moved > 1e-3, f"rank {rank}: training did not move the weights ({moved})"
        assert loss == 0.0 and max(diff.values()) == 0.0, f"rank {rank}: resumed off by {loss}, {diff}"
