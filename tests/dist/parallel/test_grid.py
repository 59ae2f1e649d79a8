"""The process grid on 4 gloo ranks: its groups follow DeepSpeed's and Megatron's layout,
a Megatron-style ``mpu`` is read into it, and ZeRO 0-3 partition and reduce over its
data-parallel group only, with the global gradient norm counting every element once."""

import copy

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.parallel import ParallelGrid, PipeModelDataParallelTopology
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, engine_train, reference_run

MICRO, STEPS, LR = 2, 3, 2.0


class MegatronStyleMPU:
    """What a Megatron-LM script passes as ``mpu``: groups it built itself, tensor innermost
    (``transposed`` puts the tensor groups across the data groups instead)."""

    def __init__(self, tp: int, *, transposed: bool = False):
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = world // tp
        tensor_lists = [list(range(s, s + tp)) for s in range(0, world, tp)]
        data_lists = [list(range(t, world, tp)) for t in range(tp)]
        if transposed:
            tensor_lists, data_lists = data_lists, tensor_lists
        self.tp, self.dp = tp, dp
        for kind, lists in (("tensor", tensor_lists), ("data", data_lists)):
            for ranks in lists:
                group = dist.new_group(ranks)
                if rank in ranks:
                    setattr(self, kind, (group, ranks.index(rank), len(ranks)))

    def get_tensor_model_parallel_group(self):
        return self.tensor[0]

    def get_tensor_model_parallel_rank(self):
        return self.tensor[1]

    def get_tensor_model_parallel_world_size(self):
        return self.tensor[2]

    def get_data_parallel_group(self):
        return self.data[0]

    def get_data_parallel_rank(self):
        return self.data[1]

    def get_data_parallel_world_size(self):
        return self.data[2]


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _grid_layout(rank, world_size):
    out = {}
    grid = ParallelGrid.build(tensor=2)
    out["tp2"] = (
        _ranks(grid.get_tensor_model_parallel_group()),
        _ranks(grid.get_data_parallel_group()),
        _ranks(grid.get_model_parallel_group()),
        grid.get_data_parallel_rank(),
        grid.get_tensor_model_parallel_rank(),
        grid.get_stage_id(),
        grid.data_comm.world_size,
        grid.tensor_comm.world_size,
        grid.get_tensor_model_parallel_src_rank(),
    )
    grid = ParallelGrid.from_topology(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    out["pp2 tp2"] = (
        _ranks(grid.get_pipe_parallel_group()),
        _ranks(grid.get_model_parallel_group()),
        grid.get_stage_id(),
        grid.is_first_stage,
        grid.is_last_stage,
        grid.stage_to_global(1),
        grid.get_model_parallel_rank(),
    )
    errors = {}
    for name, build in (
        ("tensor 3", lambda: ParallelGrid.build(tensor=3)),
        ("transposed mpu", lambda: ParallelGrid.from_mpu(MegatronStyleMPU(2, transposed=True))),
    ):
        try:
            build()
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


def test_grid_groups_follow_the_layout(tmp_path):
    reports = run_distributed(_grid_layout, world_size=4, tmp_path=tmp_path)
    for rank, report in enumerate(reports):
        tensor, data, model, dp_rank, tp_rank, stage, dp_size, tp_size, src = report["tp2"]
        assert tensor == [rank - rank % 2, rank - rank % 2 + 1]  # ranks 0..tp-1 form the first group
        assert data == [rank % 2, rank % 2 + 2]
        assert model == tensor  # no pipeline: a replica's model parallelism is its tensor group
        assert (dp_rank, tp_rank, stage, dp_size, tp_size, src) == (rank // 2, rank % 2, 0, 2, 2, rank - rank % 2)
        pipe, model, stage, first, last, to_stage1, mp_rank = report["pp2 tp2"]
        assert pipe == [rank % 2, rank % 2 + 2]
        assert model == [0, 1, 2, 3]
        assert (stage, first, last, to_stage1, mp_rank) == (rank // 2, rank < 2, rank >= 2, 2 + rank % 2, rank)
        errors = report["errors"]
        assert "tensor x pipe (3) must divide the number of ranks" in errors["tensor 3"]
        assert "shardwise's layout (tensor innermost" in errors["transposed mpu"]


# Every stage trains the same replicated TinyMLP on tensor ranks that see the same batch:
# the result must be plain 2-way data-parallel training. SGD moves weights in proportion
# to the gradient, so a reduction over the wrong group (4 ranks, or the tensor pair)
# changes the update; the norm check fails if copies held by both tensor ranks were
# counted twice (a factor sqrt(2)).
CASES = [(stage, gas, clip) for stage in (0, 1, 2, 3) for gas, clip in ((1, 0.0), (2, 0.2))]
CASES += [("3 under zero.Init(mpu=...)", 1, 0.0)]


def _train_with_mpu(rank, world_size):
    mpu = MegatronStyleMPU(2)
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.dp
    out = {}
    for stage, gas, clip in CASES:
        if isinstance(stage, str):  # built already partitioned over the mpu's data group
            config_stage = 3
            with shardwise.zero.Init(
                mpu=mpu,
                config_dict_or_path={
                    "gradient_clipping": 0.0,
                    "train_micro_batch_size_per_gpu": MICRO,
                    "zero_optimization": {"stage": 3},
                },
            ):
                model = TinyMLP(seed=3)
            reference_model = TinyMLP(seed=3)  # the same values, whole
            local = [p.ds_tensor.numel() for p in model.parameters()]
            full = [p.ds_numel for p in model.parameters()]
            assert all(loc * dp >= n and (loc - 1) * dp < n for loc, n in zip(local, full)), (local, full)
        else:
            config_stage = stage
            model = reference_model = TinyMLP(seed=3)
        batches = token_batches(num_steps=STEPS, batch=MICRO * gas * dp, seed=4)
        reference = reference_run(reference_model, batches, lr=LR, clip=clip, optimizer=torch.optim.SGD)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "steps_per_print": 1000,
            "zero_optimization": {
                "stage": config_stage,
                "reduce_bucket_size": 300,
                **(STAGE3_PARTITION_ALL if config_stage == 3 else {}),
            },
        }
        engine, *_ = shardwise.initialize(model=copy.deepcopy(model), config=config, mpu=mpu)
        norms = engine_train(engine, batches, rank=dp_rank, world_size=dp, micro=MICRO)
        shards = [
            b.grad_shard.numel() * dp == b.padded
            for b in getattr(engine.strategy, "buckets", [])
            if getattr(b, "grad_shard", None) is not None
        ]
        from shardwise.utils import groups

        out[(stage, gas, clip)] = {
            "diff": max(
                (a - b.detach()).abs().max().item() for a, b in zip(reference.model.parameters(), _full_params(engine))
            ),
            "moved": reference.movement(),
            "norms": (norms, reference.norms),
            "split": (
                engine.dp_world_size,
                engine.grid.tensor,
                engine.mpu is mpu,
                all(shards),
                len(shards),
                groups.get_data_parallel_world_size(),
                groups.get_tensor_model_parallel_world_size(),
            ),
        }
    return out


def _full_params(engine):
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("world_size", [4])
def test_zero_reduces_over_the_data_group_of_an_mpu(tmp_path, world_size):
    reports = run_distributed(_train_with_mpu, world_size=world_size, tmp_path=tmp_path)
    for rank, report in enumerate(reports):
        for case in CASES:
            stage, _, clip = case
            got = report[case]
            assert got["diff"] < 1e-4 * got["moved"], f"rank {rank} {case}: {got['diff']} (moved {got['moved']})"
            engine_norms, reference_norms = got["norms"]
            for mine, ref in zip(engine_norms, reference_norms):
                assert abs(mine - ref) <= 1e-5 * ref, f"rank {rank} {case}: norm {mine} vs {ref}"
            if clip:
                assert max(reference_norms) > clip, f"{case}: clipping never happened"
            dp_size, tp_size, same_mpu, halves, buckets, groups_dp, groups_tp = got["split"]
            assert (dp_size, tp_size, same_mpu, groups_dp, groups_tp) == (2, 2, True, 2, 2)
            if stage != 0 and stage != 1:  # each data rank holds half of every gradient bucket (not a quarter)
                assert halves and buckets >= 2, f"{case}: {buckets} buckets, halves {halves}"
