"""The legacy sequence-length curriculum and progressive layer drop on 2 ranks at ZeRO
stages 0 and 3: every training forward gets the scheduled ``curriculum_seqlen`` (at
``global_steps + 1``) and ``pld_theta`` (updated from the step count before each optimizer
step); a run resumed mid-schedule continues it exactly; training with the truncation
equals one process that truncates its full global batches itself."""

import copy
import math

import torch

import shardwise
from shardwise.runtime.data_pipeline import CurriculumScheduler, truncate_to_curriculum
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL

STEPS, SAVE_AT, MICRO, GAS, LR = 5, 2, 2, 2, 1e-2
CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 2,
    "max_difficulty": 8,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 2},
}
THETA, GAMMA = 0.5, 0.1


class _Recording(TinyMLP):
    """TinyMLP taking both features' keywords; records what each forward got and cuts its
    batch to ``curriculum_seqlen``, as a Megatron-style model does."""

    def __init__(self, seed):
        super().__init__(seed=seed)
        self.seen = []

    def forward(self, tokens, targets, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=None):
        self.seen.append((curriculum_seqlen, progressive_layer_drop, pld_theta))
        return super().forward(*truncate_to_curriculum((tokens, targets), curriculum_seqlen))


def _config(stage):
    zero = {"stage": stage, **(STAGE3_PARTITION_ALL if stage == 3 else {})}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "curriculum_learning": CURRICULUM,
        "progressive_layer_drop": {"enabled": True, "theta": THETA, "gamma": GAMMA},
    }


def _expected(step):
    """What each forward of optimizer step ``step`` (0-based) should get, from the formulas."""
    seqlen = CurriculumScheduler({k: v for k, v in CURRICULUM.items() if k != "enabled"}).get_difficulty(step + 1)
    theta = 1.0 if step == 0 else (1.0 - THETA) * math.exp(-GAMMA * (step - 1)) + THETA
    return (seqlen, True, theta)


def _train(engine, batches, rank, world_size):
    for tokens, targets in batches:
        for micro in range(GAS):
            start = (micro * world_size + rank) * MICRO
            engine.backward(engine(tokens[start : start + MICRO], targets[start : start + MICRO]))
            engine.step()


def _reference(model, batches):
    """One process, full global batches, each cut to the step's scheduled length."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step, (tokens, targets) in enumerate(batches):
        seqlen = _expected(step)[0]
        TinyMLP.forward(model, tokens[:, :seqlen], targets[:, :seqlen]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _full(module):
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return [p.detach().clone() for p in module.parameters()]


def _run_stage(rank, world_size, stage, save_dir):
    batches = token_batches(num_steps=STEPS, batch=MICRO * GAS * world_size, seed=2)
    model = _Recording(seed=1)
    reference = _reference(model, batches)
    straight, _, _, _ = shardwise.initialize(model=model, config=_config(stage))
    _train(straight, batches[:SAVE_AT], rank, world_size)
    saved_difficulty = straight.training_features.find("curriculum_learning").scheduler.get_current_difficulty()
    straight.save_checkpoint(save_dir)
    _train(straight, batches[SAVE_AT:], rank, world_size)
    expected = [_expected(step) for step in range(STEPS) for _ in range(GAS)]
    assert model.seen == expected, (model.seen, expected)
    worst = max((a - b).abs().max().item() for a, b in zip(_full(straight.module), reference.parameters()))

    resumed_model = _Recording(seed=99)
    resumed, _, _, _ = shardwise.initialize(model=resumed_model, config=_config(stage))
    resumed.load_checkpoint(save_dir)
    assert resumed.training_features.find("curriculum_learning").scheduler.get_current_difficulty() == saved_difficulty
    _train(resumed, batches[SAVE_AT:], rank, world_size)
    assert resumed_model.seen == expected[SAVE_AT * GAS :], resumed_model.seen
    same = all(torch.equal(a, b) for a, b in zip(_full(straight.module), _full(resumed.module)))
    return worst, same


def _check(rank, world_size, save_dir):
    return {stage: _run_stage(rank, world_size, stage, f"{save_dir}/stage{stage}") for stage in (0, 3)}


def test_schedule_reaches_the_forward_resumes_and_matches_one_process(tmp_path):
    reports = run_distributed(_check, world_size=2, tmp_path=tmp_path, save_dir=str(tmp_path / "ckpt"))
    for rank, report in enumerate(reports):
        for stage, (worst, same) in report.items():
            # fp32: differs from one process only by the summation order of the all-reduce
            assert worst < 2e-5, f"rank {rank} stage {stage}: max |diff| {worst}"
            assert same, f"rank {rank} stage {stage}: the resumed run's parameters differ"


def test_expected_schedule_moves_within_the_run():
    """The run covers a curriculum that changes every step, then stays, and a theta below 1."""
    assert [_expected(step)[0] for step in range(STEPS)] == [2, 4, 6, 8, 8]
    assert _expected(STEPS - 1)[2] < 1.0
