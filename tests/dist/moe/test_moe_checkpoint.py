"""Checkpoints of MoE models store every expert by its global id: a checkpoint saved with
experts split over 2 ranks (ZeRO 1 and 0, AdamW, 4 ranks) consolidates into the weights of
the same model trained with every expert local, and resumes at ep_size 4 and 1 (ZeRO
stages 0-3) so that the next step equals that reference's next step: the experts'
optimizer state went to the right experts too."""

import copy

import pytest
from moe_common import (
    EXPERTS,
    MoENet,
    expert_rank_model,
    make_batches,
    make_reference,
    moe_config,
    moe_loss,
    reference_run,
)

import shardwise
from shardwise.testing import run_distributed
from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

K, DROP, OPT = 2, False, "adamw"


def _step(engine, batch, rank):
    x, y = batch
    loss = moe_loss(engine, x[rank], y[rank])
    engine.backward(loss)
    engine.step()


def _engine(ep_size, rank, stage, model=None):
    model = model if model is not None else MoENet(ep_size, K, DROP)
    engine, _, _, _ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=moe_config(stage, OPT, 0.0, "fp32")
    )
    return engine


def _diff(engine, reference, ep_size, rank):
    expected = expert_rank_model(reference, ep_size, rank % ep_size, K, DROP).state_dict()
    got = engine.module.state_dict()
    return max(float((got[k] - expected[k]).abs().max()) for k in expected)


def _run(rank, world_size, tmp, save_stage):
    batches = make_batches(world_size)
    reference = make_reference(K, DROP)
    after_two, after_three = copy.deepcopy(reference), copy.deepcopy(reference)
    reference_run(after_two, batches[:2], OPT, 0.0)
    reference_run(after_three, batches, OPT, 0.0)

    saved = _engine(2, rank, save_stage, expert_rank_model(reference, 2, rank % 2, K, DROP))
    for batch in batches[:2]:
        _step(saved, batch, rank)
    saved.save_checkpoint(str(tmp), tag="two")
    report = {
        "full_state": max(
            float((v - after_two.state_dict()[k]).abs().max()) for k, v in saved.module_state_dict().items()
        )
    }
    report["full_keys"] = sorted(saved.module_state_dict()) == sorted(after_two.state_dict())
    if rank == 0:
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp), tag="two")
        report["consolidated_keys"] = sorted(consolidated) == sorted(after_two.state_dict())
        report["consolidated"] = max(
            float((consolidated[k] - v).abs().max()) for k, v in after_two.state_dict().items()
        )
    for ep_size, stage in ((4, 3), (1, 0)) if save_stage == 1 else ((4, 2), (1, 1)):
        engine = _engine(ep_size, rank, stage)
        engine.load_checkpoint(str(tmp), tag="two")
        report[f"loaded ep{ep_size}"] = _diff(engine, after_two, ep_size, rank)
        _step(engine, batches[2], rank)
        report[f"resumed ep{ep_size}"] = _diff(engine, after_three, ep_size, rank)
        report[f"experts ep{ep_size}"] = len(engine.module.moe.deepspeed_moe.experts.deepspeed_experts)
    report["moved"] = max(float((a - b).abs().max()) for a, b in zip(after_three.parameters(), after_two.parameters()))
    return report


@pytest.mark.parametrize("save_stage", [1, 0])
def test_moe_checkpoint_stores_experts_by_global_id(tmp_path, save_stage):
    reports = run_distributed(_run, world_size=4, tmp_path=tmp_path, tmp=tmp_path / "ckpt", save_stage=save_stage)
    assert reports[0]["consolidated_keys"] and reports[0]["consolidated"] < 1e-6, reports[0]
    for report in reports:
        assert report["full_keys"] and report["full_state"] < 1e-6, report
        assert report["moved"] > 1e-2, report  # the step after the load moves the weights
        for ep_size in (4, 1):
            assert report[f"experts ep{ep_size}"] == EXPERTS // ep_size
            assert report[f"loaded ep{ep_size}"] < 1e-6, (ep_size, report)
            assert report[f"resumed ep{ep_size}"] < 1e-5, (ep_size, report)
