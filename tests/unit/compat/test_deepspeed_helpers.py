"""The small DeepSpeed helpers scripts call: loaders, seeds, logging, MoE parameter
groups, activation checkpointing, Lion and Adagrad, consolidation sizes."""

import logging

import pytest
import torch
from torch import nn

from shardwise.checkpoint.utils import clone_tensors_for_torch_save
from shardwise.checkpointing import checkpoint, configure, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from shardwise.config import ConfigError
from shardwise.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from shardwise.ops.adagrad import DeepSpeedCPUAdagrad
from shardwise.ops.lion import DeepSpeedCPULion
from shardwise.runtime.utils import move_to_device, set_random_seed
from shardwise.utils import RepeatingLoader, log_dist
from shardwise.utils.zero_to_fp32 import _parse_size, _shards


def test_repeating_loader_restarts():
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_set_random_seed_reproduces_every_generator():
    import random

    import numpy

    set_random_seed(7)
    first = (random.random(), numpy.random.rand(), torch.rand(1).item())
    set_random_seed(7)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == first


def test_move_to_device_and_clone_for_save():
    flat = torch.arange(10.0)
    item = {"a": [flat[:2], (flat[2:4], 5)], "b": "text"}
    moved = move_to_device(item, "cpu")
    assert torch.equal(moved["a"][1][0], flat[2:4]) and moved["b"] == "text"
    cloned = clone_tensors_for_torch_save(item)
    assert cloned["a"][0].untyped_storage().nbytes() == 2 * 4  # its own storage, not the flat one
    assert isinstance(cloned["a"][1], tuple) and cloned["a"][1][1] == 5


def test_log_dist_logs_on_selected_ranks(caplog):
    logger = logging.getLogger("shardwise")
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="shardwise"):
            log_dist("hello", ranks=[0])
            log_dist("nobody", ranks=[3])
    finally:
        logger.propagate = False
    assert "[Rank 0] hello" in caplog.text and "nobody" not in caplog.text


def test_moe_groups_split_expert_parameters_only():
    shared, expert = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    assert not is_moe_param(shared) and is_moe_param(expert)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": [shared, expert], "lr": 0.1})
    assert [len(g["params"]) for g in groups] == [1, 1]
    assert groups[1]["moe"] and groups[1]["name"] == "ep_size_2" and groups[1]["lr"] == 0.1
    plain = split_params_into_different_moe_groups_for_optimizer([{"params": [shared]}])
    assert plain == [{"params": [shared]}]


def test_activation_checkpoint_gives_the_same_gradients_with_dropout():
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(3)
    checkpoint(layer, x).sum().backward()
    recomputed = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.manual_seed(3)
    layer(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(recomputed, layer.parameters()))


def test_activation_checkpoint_passes_keyword_tensors_through_autograd():
    layer = nn.Linear(4, 4)
    x, scale = torch.randn(2, 4, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    checkpoint(lambda h, *, scale: layer(h) * scale, x, scale=scale).sum().backward()
    expected = (layer(x.detach()).sum()).detach()
    assert scale.grad is not None and torch.allclose(scale.grad, expected)
    assert x.grad is not None


def test_checkpoint_configure_refuses_an_inconsistent_request():
    configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 4}})
    with pytest.raises(ConfigError, match="needs partition_activations=true"):
        configure(
            None,
            deepspeed_config={"activation_checkpointing": {"contiguous_memory_optimization": True}},
            num_checkpoints=2,
        )
    configure(None)


def test_rng_tracker_forks_without_moving_the_default_stream():
    model_parallel_cuda_manual_seed(11)
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced
    model_parallel_cuda_manual_seed(11)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)


def test_lion_matches_its_update_rule():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    start = w.detach().clone()
    optimizer = DeepSpeedCPULion([w], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    grads = [torch.randn(5) for _ in range(3)]
    m, expected = torch.zeros(5), start.clone()
    for g in grads:
        w.grad = g.clone()
        optimizer.step()
        expected = expected * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    assert torch.allclose(w.detach(), expected, atol=1e-6)
    assert not torch.allclose(w.detach(), start)


def test_cpu_adagrad_is_torch_adagrad():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    b.data.copy_(a.data)
    ours, theirs = DeepSpeedCPUAdagrad([a], lr=0.1), torch.optim.Adagrad([b], lr=0.1, eps=1e-10)
    for _ in range(3):
        g = torch.randn(4)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([a], amsgrad=True)


def test_zero_to_fp32_refuses_what_it_cannot_do(tmp_path):
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(ValueError, match="Unable to find 'latest' file .*; pass tag="):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)


def test_consolidation_shard_sizes():
    assert _parse_size("5GB") == 5 * 10**9 and _parse_size("2MiB") == 2 * 2**20 and _parse_size(100) == 100
    with pytest.raises(ValueError, match="max_shard_size"):
        _parse_size("lots")
    state = {f"t{i}": torch.zeros(250) for i in range(4)}  # 1000 bytes each
    assert _shards(state, 2500) == [["t0", "t1"], ["t2", "t3"]]
    assert _shards(state, None) == [["t0", "t1", "t2", "t3"]]
