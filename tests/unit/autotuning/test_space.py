"""The search space as data (see [Note: autotuning space]) and pruning by the estimator."""

import pytest

from shardwise.autotuning import Candidate, MemoryBudget, build_space, experiment_config, prune
from shardwise.autotuning._space import micro_batch_sizes
from shardwise.config import ConfigError
from shardwise.config._autotuning import autotuning_config


def _tuning(**keys):
    return autotuning_config(keys)


def test_names_are_deepspeeds():
    assert Candidate(1, 4, 2).name == "z1_gas2_tmbspg4"
    assert Candidate(3, 1, 1, True, True).name == "z3_gas1_tmbspg1_offopt_offparam"


@pytest.mark.parametrize(
    "bounds,count,expected",
    [((1, 1024), 3, [1, 32, 1024]), ((1, 2), 3, [1, 2]), ((3, 20), 3, [3, 8, 20]), ((1, 64), 1, [64])],
)
def test_micro_batch_ladder_spreads_over_the_bounds(bounds, count, expected):
    tuning = _tuning(
        min_train_micro_batch_size_per_gpu=bounds[0],
        max_train_micro_batch_size_per_gpu=bounds[1],
        num_tuning_micro_batch_sizes=count,
    )
    assert micro_batch_sizes({}, tuning) == expected


def test_user_micro_batch_fixed_or_listed():
    assert micro_batch_sizes({"train_micro_batch_size_per_gpu": 4}, _tuning()) == [4]
    assert micro_batch_sizes({"train_micro_batch_size_per_gpu": [8, 2]}, _tuning()) == [2, 8]


def test_stages_from_the_user_config():
    tuning = _tuning(max_train_micro_batch_size_per_gpu=1)
    assert {c.stage for c in build_space({}, tuning, world_size=2)} == {0, 1, 2, 3}
    assert {c.stage for c in build_space({"zero_optimization": {"stage": 2}}, tuning, world_size=2)} == {2}
    with pytest.raises(ConfigError, match='stage must be 0-3, a list of them or "all"'):
        build_space({"zero_optimization": {"stage": 5}}, tuning, world_size=2)


def test_a_fixed_global_batch_is_kept():
    user = {"train_batch_size": 16, "zero_optimization": {"stage": 1}}
    space = build_space(user, _tuning(max_train_micro_batch_size_per_gpu=16), world_size=2)
    assert [(c.micro_batch, c.gas) for c in space] == [(1, 8), (4, 2)]  # 16 // (16 x 2): left out
    assert all(c.micro_batch * c.gas * 2 == 16 for c in space)


def test_unfixed_global_batch_follows_the_user_accumulation_and_bounds():
    user = {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 0}}
    tuning = _tuning(max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=4, max_train_batch_size=16)
    assert [(c.micro_batch, c.gas) for c in build_space(user, tuning, world_size=2)] == [(1, 2), (2, 2), (4, 2)]


def test_no_candidate_is_a_named_error():
    with pytest.raises(ConfigError, match="no configuration satisfies the batch bounds"):
        build_space({"train_batch_size": 3}, _tuning(max_train_micro_batch_size_per_gpu=2), world_size=2)


def test_offload_only_outside_fast_mode():
    user = {"zero_optimization": {"stage": [0, 3]}}
    fast = build_space(user, _tuning(max_train_micro_batch_size_per_gpu=1), world_size=1)
    full = build_space(user, _tuning(max_train_micro_batch_size_per_gpu=1, fast=False), world_size=1)
    assert not any(c.offload_optimizer for c in fast)
    assert {(c.stage, c.offload_optimizer, c.offload_param) for c in full} == {
        (0, False, False),
        (3, False, False),
        (3, True, False),
        (3, True, True),
    }


def test_experiment_config_replaces_the_tuned_keys():
    user = {"train_batch_size": 16, "zero_optimization": {"stage": "all", "offload_param": {"device": "cpu"}},
            "autotuning": {"enabled": True, "results_dir": "r", "fast": False}}  # fmt: skip
    config = experiment_config(user, Candidate(2, 4, 2, True), dp=2, metric_path="/m.json")
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (16, 4, 2)
    assert config["autotuning"] == {"enabled": True, "fast": False, "metric_path": "/m.json"}
    assert user["zero_optimization"]["stage"] == "all"  # the user's dict is left alone


def test_pruning_drops_what_does_not_fit():
    # 1M fp32 parameters on 2 ranks: stage 0 needs 16 MiB, stage 1 12 MiB, stage 2 10 MiB
    budget = MemoryBudget(num_params=2**20, dtype="fp32", num_nodes=1, ranks_per_node=2,
                          bytes_per_rank=12 * 2**20, on_cpu=False)  # fmt: skip
    kept, rejected = prune([Candidate(0, 1, 1), Candidate(1, 1, 1), Candidate(2, 1, 1)], budget)
    assert kept == [Candidate(1, 1, 1), Candidate(2, 1, 1)]
    assert "0.016 GiB per rank; 0.012 GiB is available" in rejected[Candidate(0, 1, 1)]


def test_offload_counts_on_cpu_but_not_on_gpu():
    offloaded = Candidate(1, 1, 1, True)
    gpu = MemoryBudget(num_params=2**20, dtype="fp32", num_nodes=1, ranks_per_node=2,
                       bytes_per_rank=9 * 2**20, on_cpu=False)  # fmt: skip
    assert prune([offloaded], gpu)[0] == [offloaded]  # 8 MiB on the device
    cpu = MemoryBudget(**{**gpu.__dict__, "on_cpu": True})
    assert prune([offloaded], cpu)[0] == []  # 12 MiB in the same memory


def test_tensor_and_pipeline_degrees_that_divide_the_world():
    user = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 16,
            "tensor_parallel": {"autotp_size": "auto"}, "pipeline": {"stages": [1, 2, 3]}}  # fmt: skip
    space = build_space(user, _tuning(), world_size=4)
    # tp in {1, 2, 4} x pp in {1, 2} with tp x pp dividing 4; pp 3 never; accumulation keeps 16
    assert [(c.tp, c.pp, c.gas) for c in space] == [(1, 1, 2), (1, 2, 4), (2, 1, 4), (2, 2, 8), (4, 1, 8)]
    assert space[3].name == "z1_gas8_tmbspg2_tp2_pp2"
    config = experiment_config(user, space[3], dp=1, metric_path="/m.json")
    assert (config["tensor_parallel"]["autotp_size"], config["pipeline"]["stages"]) == (2, 2)
    assert config["train_batch_size"] == 16
    # a number is kept, "auto" stages is DeepSpeed's (the script decides): neither is searched
    fixed = build_space({**user, "tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": "auto"}},
                        _tuning(), world_size=4)  # fmt: skip
    assert [(c.tp, c.pp) for c in fixed] == [(2, 1)]
    kept = experiment_config({"pipeline": {"stages": "auto"}}, fixed[0], dp=2, metric_path="m")
    assert kept["pipeline"] == {"stages": "auto"}  # left to the script
    with pytest.raises(ConfigError, match=r"autotp_size in \[3\] and pipeline.stages in \[1\] divides the 4 rank"):
        build_space({**user, "tensor_parallel": {"autotp_size": [3]}, "pipeline": {}}, _tuning(), world_size=4)
    with pytest.raises(ConfigError, match="pipeline.stages must be a positive integer"):
        build_space({**user, "pipeline": {"stages": [0]}}, _tuning(), world_size=4)


def test_tensor_and_pipeline_degrees_shrink_the_estimate():
    # 1M fp32 parameters, stage 0, 4 ranks: 16 MiB per rank whole, 8 MiB split over 2 ranks
    budget = MemoryBudget(num_params=2**20, dtype="fp32", num_nodes=1, ranks_per_node=4,
                          bytes_per_rank=10 * 2**20, on_cpu=False)  # fmt: skip
    whole, tp2, pp2 = Candidate(0, 1, 1), Candidate(0, 1, 1, tp=2), Candidate(0, 1, 1, pp=2)
    kept, rejected = prune([whole, tp2, pp2], budget)
    assert kept == [tp2, pp2] and "0.016 GiB per rank" in rejected[whole]


def test_candidates_that_only_add_work_for_the_same_memory_are_pruned():
    # one data-parallel rank: stages 1-3 shard nothing; on CPU, offload saves nothing either
    one = MemoryBudget(num_params=2**20, dtype="fp32", num_nodes=1, ranks_per_node=1,
                       bytes_per_rank=2**30, on_cpu=True)  # fmt: skip
    space = [Candidate(s, m, 1) for s in (0, 1, 2) for m in (1, 2)] + [Candidate(1, 2, 1, True)]
    kept, rejected = prune(space, one)
    assert kept == [Candidate(0, 1, 1), Candidate(0, 2, 1)]
    assert rejected[Candidate(2, 2, 1)].startswith("dominated by z0_gas1_tmbspg2:")
    # two ranks: each stage saves memory, so every one is kept; on GPU offload saves device memory
    two = MemoryBudget(**{**one.__dict__, "ranks_per_node": 2, "on_cpu": False})
    assert prune(space, two)[0] == space
