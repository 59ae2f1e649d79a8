"""ZeRO stages 1, 2 and 3 on 2 and 4 ranks match single-process training on the same batches
(AdamW with per-group options; plain SGD, whose update scales with the gradient, at stages
0-3 with accumulation, fp16, bf16 and an fp16 overflow the training recovers from)."""

import copy

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import (
    STAGE3_PARTITION_ALL,
    engine_train,
    max_param_diff,
    param_groups,
    reference_run,
    reference_train,
)

MICRO, STEPS, LR, WD = 2, 4, 1e-2, 0.01
# fp32 differs only by reduction order. bf16/fp16 compute with 8/11-bit mantissas on fp32
# masters; Adam turns the rounding of near-zero gradients into updates of up to lr per step,
# so after 4 steps at lr 1e-2 a few elements differ by ~2e-2 (stage 0 shows the same).
TOLERANCE = {"fp32": 2e-5, "bf16": 5e-2, "fp16": 3e-2}
# That bound is about the distance AdamW moves any weight in 4 steps (0.04), so it alone
# would pass an engine that never updates. The update as a whole (``update_error``: |engine -
# reference| / |reference - initial|) is measured at 0.057 (bf16) and 0.026 (fp16) at most.
UPDATE_TOLERANCE = {"fp32": 1e-4, "bf16": 0.15, "fp16": 0.1}

# (name, stage, gas, clip, dtype, frozen, two param groups[, passes through the layers])
CASES = [
    ("s3 fp32", 3, 1, 0.0, "fp32", False, False),
    ("s3 gas2 clip groups frozen", 3, 2, 0.2, "fp32", True, True),
    ("s3 layers called twice", 3, 2, 0.2, "fp32", False, False, 2),
    ("s3 bf16 gas2", 3, 2, 0.2, "bf16", False, True),
    ("s3 fp16 gas2", 3, 2, 0.2, "fp16", False, False),
    # DeepSpeed's stage 3 defaults: every TinyMLP parameter is persistent (below 1e5 elements)
    ("s3 defaults: persistent", 3, 2, 0.2, "fp32", True, True, 1, {}),
    ("s3 bf16 defaults: persistent", 3, 2, 0.2, "bf16", False, True, 1, {}),
    # units kept whole from forward to backward (reuse), within a live-parameter cap
    (
        "s3 reuse under a live cap, twice",
        3,
        2,
        0.2,
        "fp32",
        False,
        False,
        2,
        {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1200},
    ),
    ("s1 fp32", 1, 1, 0.0, "fp32", False, False),
    ("s1 gas2 clip groups frozen", 1, 2, 0.2, "fp32", True, True),
    ("s2 fp32", 2, 1, 0.0, "fp32", False, False),
    ("s2 gas3 clip groups frozen", 2, 3, 0.1, "fp32", True, True),
    ("s1 bf16 gas2", 1, 2, 0.2, "bf16", False, False),
    ("s2 bf16 gas2", 2, 2, 0.2, "bf16", False, True),
    ("s2 fp16 gas2", 2, 2, 0.2, "fp16", False, False),
]


def _config(stage, gas, clip, dtype, bucket, knobs=None):
    if knobs is None:
        knobs = STAGE3_PARTITION_ALL if stage == 3 else {}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, **knobs},
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    return config


def _check(rank, world_size, cases):
    report = {}
    for name, stage, gas, clip, dtype, frozen, groups, *extra in cases:
        passes, knobs = (extra[0] if extra else 1), (extra[1] if len(extra) > 1 else None)
        model = TinyMLP(seed=1, freeze_first=frozen, passes=passes)
        batches = token_batches(num_steps=STEPS, batch=MICRO * gas * world_size, seed=2)
        reference = reference_run(model, batches, lr=LR, weight_decay=WD, clip=clip, split_groups=groups)
        candidate = copy.deepcopy(model)
        engine, _, _, _ = shardwise.initialize(
            model=candidate,
            model_parameters=param_groups(candidate, split=groups, lr=LR, weight_decay=WD),
            config=_config(stage, gas, clip, dtype, bucket=300, knobs=knobs),
        )  # small buckets: several per group
        norms = engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
        report[name] = (
            max_param_diff(reference.model, engine.module),
            reference.update_error(engine.module),
            len(engine.strategy.buckets),
            max(norms),
        )
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_stages_match_single_process(tmp_path, world_size):
    reports = run_distributed(_check, world_size=world_size, tmp_path=tmp_path, cases=CASES)
    for rank, report in enumerate(reports):
        for name, _, _, clip, dtype, _, _, *extra in CASES:
            diff, update_error, buckets, largest_norm = report[name]
            if clip:  # clipping must have scaled at least one step, or the case tests nothing
                assert largest_norm > clip, f"{name}: gradient norm {largest_norm} never above clip {clip}"
            if len(extra) < 2:  # persistent parameters share one unit per group
                assert buckets >= 3, f"{name}: expected several buckets, got {buckets}"
            assert diff < TOLERANCE[dtype], f"rank {rank} {name}: max |diff| {diff}"
            assert update_error < UPDATE_TOLERANCE[dtype], f"rank {rank} {name}: update off by {update_error:.3g}"
    assert all(r == reports[0] for r in reports)  # every rank holds the same parameters


# Plain SGD: a gradient off by a factor (loss scale, accumulation count, world size) moves
# the weights by that factor, which AdamW's normalised update would hide. lr 2 moves some
# weight by ~0.12 in 4 steps, so mixed-precision tolerances can sit far below that
# movement: an engine that never updated the weights would be off by all of it.
SGD_LR, SGD_STEPS = 2.0, 4
OF_MOVEMENT = {"fp32": 1e-4, "fp16": 0.02, "bf16": 0.1}
"""Largest |diff| allowed, as a fraction of the reference's largest movement (measured:
fp16 0.003, bf16 0.029)."""
NORM_RTOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-2}
"""Relative tolerance of ``get_global_grad_norm()`` against ``clip_grad_norm_``'s value."""

# (name, stage, gas, clip, dtype[, rank 0's first micro-step overflows])
SGD_CASES = [
    (f"s{stage} {dtype} gas2", stage, 2, 0.0, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "fp16", "bf16")
]
SGD_CASES += [("s2 fp32 gas3 clip", 2, 3, 0.2, "fp32"), ("s3 fp32 gas1 clip", 3, 1, 0.2, "fp32")]
SGD_CASES += [(f"s{stage} fp16 overflow, then recovers", stage, 2, 0.0, "fp16", True) for stage in (0, 1, 2, 3)]


def _sgd_config(stage, gas, clip, dtype):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}},
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            **(STAGE3_PARTITION_ALL if stage == 3 else {}),
        },
    }
    if dtype == "fp16":  # a short window: the scale regrows within the test after an overflow
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _check_sgd(rank, world_size, cases):
    report = {}
    for name, stage, gas, clip, dtype, *overflow in cases:
        overflow = bool(overflow and overflow[0])
        model = TinyMLP(seed=1)
        batches = token_batches(num_steps=SGD_STEPS + overflow, batch=MICRO * gas * world_size, seed=2)
        # the overflowed step is skipped: the reference never sees its batch
        reference = reference_run(model, batches[overflow:], lr=SGD_LR, clip=clip, optimizer=torch.optim.SGD)
        engine, _, _, _ = shardwise.initialize(model=copy.deepcopy(model), config=_sgd_config(stage, gas, clip, dtype))
        norms, grads_left = [], 0
        for tokens, targets in batches:
            for micro_step in range(gas):
                start = (micro_step * world_size + rank) * MICRO
                loss = engine(tokens[start : start + MICRO], targets[start : start + MICRO])
                if overflow and rank == 0 and engine.global_steps == 0 and micro_step == 0:
                    loss = loss * float("inf")
                engine.backward(loss)
                # stages 2 and 3 hold gradient shards only: autograd's .grad must be released
                grads_left += sum(p.grad is not None for p in engine.module.parameters())
                engine.step()
            norms.append(engine.get_global_grad_norm())
        report[name] = {
            "diff": max_param_diff(reference.model, engine.module),
            "moved": reference.movement(),
            "norms": norms[overflow:],
            "reference_norms": reference.norms,
            "grads_left": grads_left,
            "skipped": engine.skipped_steps,
            "scale": engine.get_loss_scale(),
        }
    return report


def test_sgd_matches_single_process_at_every_stage(tmp_path):
    reports = run_distributed(_check_sgd, world_size=2, tmp_path=tmp_path, cases=SGD_CASES)
    for rank, report in enumerate(reports):
        for name, stage, _gas, clip, dtype, *overflow in SGD_CASES:
            r = report[name]
            where = f"rank {rank} {name}: max |diff| {r['diff']:.3g}, reference moved {r['moved']:.3g}"
            assert r["diff"] < OF_MOVEMENT[dtype] * r["moved"], where
            for step, (got, expected) in enumerate(zip(r["norms"], r["reference_norms"])):
                assert abs(got - expected) <= NORM_RTOL[dtype] * expected, (
                    f"rank {rank} {name}: step {step} gradient norm {got}, clip_grad_norm_ {expected}"
                )
            if clip:  # clipping must have scaled at least one step, or the case tests nothing
                assert max(r["reference_norms"]) > clip, where
            if stage >= 2:
                assert r["grads_left"] == 0, f"{name}: {r['grads_left']} parameters kept a .grad after backward"
            if overflow:  # one skipped step, then every step applied and the scale regrown
                assert r["skipped"] == 1, f"rank {rank} {name}: {r['skipped']} steps skipped, expected 1"
                assert r["scale"] == 2**9, f"rank {rank} {name}: loss scale {r['scale']}, expected 2**9"
    assert all(r == reports[0] for r in reports)


class _HeadLogits(torch.autograd.Function):
    """``h @ weight.T`` as a fused loss head computes it (TRL's chunked log-probabilities):
    the weight is saved in the forward and read again in the backward."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(h, weight)
        return h @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        return grad @ weight, grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1])


class _ExternalUse(torch.nn.Module):
    """Uses ``a.weight`` in its own forward as well as inside ``a``; declared with
    ``register_external_parameter``, or not (then it also reads ``out``'s parameters
    without calling ``out``, through a fused head: DeepSpeed gathers a parameter read
    during a forward)."""

    def __init__(self, declared: bool):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(32, 16)
        self.a = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 32)
        self.declared = declared
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        if declared:
            from shardwise.zero import register_external_parameter

            register_external_parameter(self, self.a.weight)

    def forward(self, tokens, targets):
        h = self.a(torch.tanh(self.embed(tokens) @ self.a.weight.t()))
        logits = self.out(h) if self.declared else _HeadLogits.apply(h, self.out.weight) + self.out.bias
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))


def _external(rank, world_size):
    diffs = []
    for declared in (True, False):
        model = _ExternalUse(declared)
        batches = token_batches(num_steps=3, batch=MICRO * world_size, seed=2)
        reference = reference_train(model, batches, lr=LR, weight_decay=WD, clip=0.0, split_groups=False)
        engine, _, _, _ = shardwise.initialize(model=copy.deepcopy(model), config=_config(3, 1, 0.0, "fp32", 300))
        engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
        diffs.append(max_param_diff(reference, engine.module))
    return diffs


def test_stage3_parameter_used_outside_its_module(tmp_path):
    for declared, undeclared in run_distributed(_external, world_size=2, tmp_path=tmp_path):
        assert declared < TOLERANCE["fp32"], f"register_external_parameter: max |diff| {declared}"
        assert undeclared < TOLERANCE["fp32"], f"read during the forward, not declared: max |diff| {undeclared}"
