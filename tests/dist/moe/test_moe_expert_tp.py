"""Experts split over the tensor group (``enable_expert_tensor_parallelism=True``) on tp 2 x
dp 2 with ep 2 (4 ranks) train as the single-process model with whole experts: per-step
losses and final weights, ZeRO 0, 2 and 3, SGD and AdamW, top-1 and top-2, with and without
drops, clipping on the global norm, each tensor rank moving all its tokens or its share of
them; each rank holds its tensor rank's slice of each of its experts (column-parallel first
linear, row-parallel last); a checkpoint saved in that layout resumes in it and loads at
tp 1, and consolidates to the whole model.

The reference is ``moe_common``'s: the model with every expert local, one forward per data
rank's micro-batch (each tensor rank of a data rank sees the same one), losses averaged.
"""

import copy

from moe_common import EXPERTS, expert_rank_model, make_batches, make_reference, moe_config, moe_loss, reference_run

import shardwise
from shardwise.testing import run_distributed
from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
LOCAL = EXPERTS // 2


def _tp_model(reference, grid, k, drop, prebuilt=False):
    """The model as this rank holds it before initialize: its expert rank's experts whole
    (``prebuilt``: already split, as a user builds them from shardwise's tensor-parallel
    layers), the input layer column-parallel (the non-expert layers are tensor-parallel)."""
    from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    model = expert_rank_model(reference, 2, grid.get_data_parallel_rank(), k, drop, expert_tp=True)
    model.inp = ColumnParallelLinear.from_linear(model.inp, group=grid, gather_output=True)
    for expert in model.moe.deepspeed_moe.experts.deepspeed_experts if prebuilt else ():
        marks = {"allreduce": False, "group_name": expert[0].weight.group_name}
        expert[0] = ColumnParallelLinear.from_linear(expert[0], group=grid)
        expert[2] = RowParallelLinear.from_linear(expert[2], group=grid)
        for p in expert.parameters():
            vars(p).update(marks)
    return model


def _expected_slice(key, full_state, grid):
    """This rank's part of ``key`` in the whole-expert model's state ``full_state``: the
    input layer's and each expert's column-parallel rows, the row-parallel columns."""
    t, tp = grid.tensor_rank, grid.tensor
    if key.startswith(PREFIX):
        index, rest = key[len(PREFIX) :].split(".", 1)
        full = full_state[f"{PREFIX}{grid.get_data_parallel_rank() * LOCAL + int(index)}.{rest}"]
        if rest.startswith("0."):  # Linear(HIDDEN, 12): column-parallel, rows split
            return full.chunk(tp, dim=0)[t]
        if rest == "2.weight":  # Linear(12, HIDDEN): row-parallel, columns split; bias whole
            return full.chunk(tp, dim=1)[t]
        return full
    if key.startswith("inp."):
        return full_state[key].chunk(tp, dim=0)[t]
    return full_state[key]


def _diff_and_shapes(engine, full_state, grid):
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO 3: this rank's slices whole
        got = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    expected = {key: _expected_slice(key, full_state, grid) for key in got}
    shapes_ok = all(got[k].shape == expected[k].shape for k in got)
    return max(float((got[k] - expected[k]).abs().max()) for k in got), shapes_ok, sorted(got)


def _train_case(grid, case):
    stage, opt, k, drop, clip, *options = case
    options = options[0] if options else {}
    reference = make_reference(k, drop)
    batches = [(x[:2], y[:2]) for x, y in make_batches(2)]  # one micro-batch per data rank
    ref_final = copy.deepcopy(reference)
    ref_losses, _ = reference_run(ref_final, batches, opt, clip)
    model = _tp_model(reference, grid, k, drop, prebuilt=options.get("prebuilt", False))
    engine, _, _, _ = shardwise.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=moe_config(stage, opt, clip, "fp32", options.get("zero")),
        mpu=grid,
    )
    moe = engine.module.moe.deepspeed_moe
    on_one_host = moe.tensor_token_shares
    moe.tensor_token_shares = options.get("shares", False)  # which exchange is tested
    data_rank, losses = grid.get_data_parallel_rank(), []
    for x, y in batches:
        loss = moe_loss(engine, x[data_rank], y[data_rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1)
        grid.data_comm.all_reduce(mean).wait()
        losses.append(float(mean) / grid.data)
    diff, shapes_ok, keys = _diff_and_shapes(engine, ref_final.state_dict(), grid)
    experts = engine.module.moe.deepspeed_moe.experts.deepspeed_experts
    whole = engine.module_state_dict()
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weights": diff,
        "shapes_ok": shapes_ok,
        "keys": keys == sorted(expert_rank_model(reference, 2, 0, k, drop).state_dict()),
        "moved": max(float((a - b).abs().max()) for a, b in zip(ref_final.parameters(), reference.parameters())),
        "held": [_shape(expert[0].weight) + _shape(expert[2].weight) for expert in experts],
        "kinds": [type(expert[0]).__name__ + "/" + type(expert[2]).__name__ for expert in experts],
        "whole_state": max(float((whole[k] - v).abs().max()) for k, v in ref_final.state_dict().items()),
        "expert_tp_size": shardwise.utils.groups._get_expert_model_parallel_world_size(),
        "shares_on_one_host": on_one_host,
    }


def _shape(param):
    return tuple(getattr(param, "ds_shape", param.shape))  # ZeRO 3: the shape this rank's slice has whole


def _run(rank, world_size, cases):
    from shardwise.parallel import ParallelGrid

    grid = ParallelGrid.build(tensor=2)
    reports = [_train_case(grid, case) for case in cases]
    groups = shardwise.utils.groups  # DeepSpeed's call for these groups: the grid's, as built
    groups._create_expert_data_and_model_parallel(2, grid)
    return reports, groups._get_expert_parallel_group_ranks("ep_size_2"), groups._get_expert_model_parallel_world_size()


# (zero stage, optimizer, k, drop_tokens, gradient_clipping[, {"zero": zero_optimization keys,
# "prebuilt": experts built from tensor-parallel layers, "shares": each tensor rank moves its
# share of the tokens, as across hosts}])
CASES = [
    (0, "sgd", 2, True, 0.3, {"shares": True}),
    (0, "adamw", 1, False, 0.0),
    (2, "sgd", 1, True, 0.0, {"shares": True}),
    (2, "adamw", 2, False, 0.3),
    (3, "adamw", 2, True, 0.3, {"zero": {"stage3_param_persistence_threshold": 0}, "shares": True}),
    (2, "sgd", 2, True, 0.3, {"prebuilt": True}),
]


def test_tensor_parallel_experts_train_as_whole_experts(tmp_path):
    reports = run_distributed(_run, world_size=4, tmp_path=tmp_path, cases=CASES)
    for rank, (report, ep_ranks, expert_tp_size) in enumerate(reports):
        # DeepSpeed's E + M + D layout: tensor rank t's expert-parallel group is [t, t + 2]
        assert (list(ep_ranks), expert_tp_size) == ([rank % 2, rank % 2 + 2], 2)
        for case, r in zip(CASES, report):
            assert r["loss"] < 2e-6, (case, rank, r)
            assert r["weights"] < 2e-6, (case, rank, r)
            assert r["whole_state"] < 2e-6, (case, rank, r)
            assert r["moved"] > 1e-2, (case, r)
            assert r["shapes_ok"] and r["keys"], (case, rank, r)  # DeepSpeed's names, 1/tp slices
            # each of the 2 local experts: column [12/2, 8], row [8, 12/2]
            assert r["held"] == [(6, 8, 8, 6)] * LOCAL, r
            assert r["kinds"] == ["ColumnParallelLinear/RowParallelLinear"] * LOCAL, r
            assert r["expert_tp_size"] == 2
            assert r["shares_on_one_host"] is False  # every rank on this host: each moves all its tokens


def _checkpoint(rank, world_size, tmp):
    from shardwise.parallel import ParallelGrid

    k, drop, opt = 2, False, "adamw"
    reference = make_reference(k, drop)
    batches = [(x[:2], y[:2]) for x, y in make_batches(2)]
    after_two, after_three = copy.deepcopy(reference), copy.deepcopy(reference)
    reference_run(after_two, batches[:2], opt, 0.0)
    reference_run(after_three, batches, opt, 0.0)
    grid = ParallelGrid.build(tensor=2)
    data_rank = grid.get_data_parallel_rank()

    def tp_engine(stage):
        model = _tp_model(reference, grid, k, drop)
        config = moe_config(stage, opt, 0.0, "fp32")
        return shardwise.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=grid)[0]

    def step(engine, batch):
        engine.backward(moe_loss(engine, batch[0][data_rank], batch[1][data_rank]))
        engine.step()

    saved = tp_engine(2)
    for batch in batches[:2]:
        step(saved, batch)
    saved.save_checkpoint(str(tmp), tag="two")
    report = {}
    if rank == 0:
        whole = get_fp32_state_dict_from_zero_checkpoint(str(tmp), tag="two")
        report["consolidated"] = max(float((whole[k] - v).abs().max()) for k, v in after_two.state_dict().items())
    resumed = tp_engine(0)
    resumed.load_checkpoint(str(tmp), tag="two")
    report["loaded tp2"] = _diff_and_shapes(resumed, after_two.state_dict(), grid)[0]
    step(resumed, batches[2])
    report["resumed tp2"] = _diff_and_shapes(resumed, after_three.state_dict(), grid)[0]
    # tp 1 on the same 4 ranks: data 4, ep 2, whole experts, a plain input layer
    model = expert_rank_model(reference, 2, rank % 2, k, drop)
    plain = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=moe_config(2, opt, 0.0, "fp32")
    )
    plain = plain[0]
    plain.load_checkpoint(str(tmp), tag="two")
    expected = expert_rank_model(after_two, 2, rank % 2, k, drop).state_dict()
    got = plain.module.state_dict()
    report["loaded tp1"] = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    return report


def test_tensor_parallel_expert_checkpoints(tmp_path):
    reports = run_distributed(_checkpoint, world_size=4, tmp_path=tmp_path, tmp=tmp_path / "ckpt")
    assert reports[0]["consolidated"] < 1e-6, reports[0]
    for report in reports:
        for key in ("loaded tp2", "resumed tp2", "loaded tp1"):
            assert report[key] < 2e-6, (key, report)


def _refusals(rank, world_size):
    """A hidden size the tensor group cannot split, and an expert that is not a
    Linear -> row-wise -> Linear chain, are refused at initialize, by name."""
    from torch import nn

    from shardwise.moe.layer import MoE
    from shardwise.parallel import ParallelGrid

    grid = ParallelGrid.build(tensor=2)
    errors = []
    for expert in (
        nn.Sequential(nn.Linear(8, 7), nn.GELU(), nn.Linear(7, 8)),
        nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 8)),
    ):
        model = nn.Sequential(MoE(8, expert, num_experts=4, ep_size=2, enable_expert_tensor_parallelism=True))
        try:
            shardwise.initialize(
                model=model, model_parameters=model.parameters(), config=moe_config(0, "sgd", 0.0, "fp32"), mpu=grid
            )
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_tensor_parallel_experts_are_refused(tmp_path):
    for errors in run_distributed(_refusals, world_size=4, tmp_path=tmp_path):
        assert len(errors) == 2, errors
        assert "0.out_features=7 (the expert's hidden size) is not divisible by the tensor-parallel size 2" in errors[0]
        assert "its module '1' (LayerNorm) is not a row-wise function or an nn.Linear" in errors[1]
        assert "leave enable_expert_tensor_parallelism False" in errors[1]
