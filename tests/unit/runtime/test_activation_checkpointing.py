"""deepspeed.checkpointing on one process: recompute parity (dropout, the RNG tracker,
autocast), what is saved for backward (cpu_checkpointing), configure's precedence and its
errors. Partitioning across a tensor group is in tests/dist/runtime/."""

import json
import logging

import pytest
import torch
from torch import nn

from shardwise import checkpointing
from shardwise.accelerator import Accelerator
from shardwise.config import ConfigError, load_config
from shardwise.runtime.activation_checkpointing._rng import TRACKER
from shardwise.runtime.activation_checkpointing._settings import SETTINGS


@pytest.fixture(autouse=True)
def _fresh_settings():
    SETTINGS.reset()
    TRACKER.reset()
    yield
    SETTINGS.reset()
    TRACKER.reset()


class _TrackedBlock(nn.Module):
    """Dropout outside and inside the tracker's model-parallel state, as a Megatron layer."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.inner(x))
        with checkpointing.get_cuda_rng_tracker().fork():
            h = self.drop(h)
        return self.outer(h)


def _grads(module, x, *, checkpointed, seed=3):
    module.zero_grad()
    x = x.detach().requires_grad_()
    checkpointing.model_parallel_cuda_manual_seed(seed)
    out = checkpointing.checkpoint(module, x) if checkpointed else module(x)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()], out.detach()


def _saved(fn):
    """What autograd saves while ``fn`` runs: (tensor, device, shares storage with) tuples."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def test_recompute_matches_the_uncheckpointed_block_with_dropout_inside_and_outside_fork():
    torch.manual_seed(0)
    block, x = _TrackedBlock(), torch.randn(16, 8)
    expected, expected_out = _grads(block, x, checkpointed=False)
    got, out = _grads(block, x, checkpointed=True)
    assert torch.equal(out, expected_out)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_recompute_leaves_the_random_streams_where_backward_found_them():
    torch.manual_seed(0)
    block, x = _TrackedBlock(), torch.randn(4, 8, requires_grad=True)
    checkpointing.model_parallel_cuda_manual_seed(5)
    out = checkpointing.checkpoint(block, x)
    before, tracker_before = torch.get_rng_state(), TRACKER.get_states()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(tracker_before[k], v) for k, v in TRACKER.get_states().items())


def test_outputs_keep_non_tensors_and_integer_tensors_and_keyword_tensors_get_gradients():
    layer = nn.Linear(4, 4)
    x, scale = torch.randn(2, 4, requires_grad=True), torch.tensor(3.0, requires_grad=True)

    def block(h, label, *, scale):
        y = layer(h) * scale
        return y, label, y.argmax(-1)

    y, label, index = checkpointing.checkpoint(block, x, "tag", scale=scale)
    assert label == "tag" and not index.requires_grad and index.dtype == torch.int64
    y.sum().backward()
    assert torch.allclose(scale.grad, layer(x.detach()).sum().detach())
    assert x.grad is not None and layer.weight.grad is not None


def test_recompute_runs_under_the_forwards_autocast_state():
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 8), torch.randn(4, 8)
    results = []
    for checkpointed in (False, True):
        layer.zero_grad()
        h = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpointing.checkpoint(layer, h) if checkpointed else layer(h)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        results.append((layer.weight.grad.clone(), h.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_plain_checkpoint_saves_only_its_inputs_and_cpu_checkpointing_saves_host_copies():
    layer, x = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), torch.randn(4, 8, requires_grad=True)
    saved, _ = _saved(lambda: checkpointing.checkpoint(layer, x))
    assert len(saved) == 1 and saved[0] is x  # the input itself, nothing of the block
    checkpointing.configure(None, checkpoint_in_cpu=True)
    saved, out = _saved(lambda: checkpointing.checkpoint(layer, x))
    assert len(saved) == 1 and saved[0].device.type == "cpu"
    assert saved[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # a copy, not the input
    assert torch.equal(saved[0], x.detach())
    out.sum().backward()
    grad = layer[0].weight.grad.clone()
    layer.zero_grad()
    layer(x).sum().backward()
    assert torch.equal(grad, layer[0].weight.grad)


def test_integer_inputs_and_parameters_are_kept_by_reference():
    checkpointing.configure(None, checkpoint_in_cpu=True)
    weight = nn.Parameter(torch.randn(4, 4))
    x, index = torch.randn(2, 4, requires_grad=True), torch.tensor([1, 0])
    saved, out = _saved(lambda: checkpointing.checkpoint(lambda h, w, i: (h @ w)[i], x, weight, index))
    assert saved[1] is weight and saved[2] is index and saved[0] is not x
    out.sum().backward()
    assert weight.grad is not None


def test_partition_activations_needs_a_tensor_group_and_keeps_inputs_whole_on_one_rank(caplog):
    with pytest.raises(ValueError, match="needs a tensor-parallel group"):
        checkpointing.configure(None, partition_activations=True)

    class OneRank:  # an mpu whose tensor-parallel group is this rank alone
        def get_tensor_model_parallel_group(self):
            return None

        def get_tensor_model_parallel_rank(self):
            return 0

        def get_tensor_model_parallel_world_size(self):
            return 1

    with caplog.at_level(logging.WARNING, logger="shardwise"):
        checkpointing.configure(OneRank(), partition_activations=True)
    assert "nothing to divide" in caplog.text and "pass an mpu_" in caplog.text
    x = torch.randn(4, 8, requires_grad=True)
    saved, _ = _saved(lambda: checkpointing.checkpoint(nn.Linear(8, 8), x))
    assert saved == [x]


def test_configure_arguments_override_the_config_section(tmp_path):
    section = {
        "partition_activations": False,
        "cpu_checkpointing": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": False,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    train_config = load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": section}, world_size=1)
    assert not checkpointing.is_configured()
    for source in (path, str(path), {"activation_checkpointing": section}, train_config):
        checkpointing.configure(None, deepspeed_config=source)
        assert checkpointing.is_configured()
        assert (SETTINGS.cpu_checkpointing, SETTINGS.num_checkpoints, SETTINGS.synchronize, SETTINGS.profile) == (
            True,
            4,
            True,
            False,
        )
    checkpointing.configure(
        None, deepspeed_config=path, checkpoint_in_cpu=False, num_checkpoints=2, synchronize=False, profile=True
    )
    assert (SETTINGS.cpu_checkpointing, SETTINGS.num_checkpoints, SETTINGS.synchronize, SETTINGS.profile) == (
        False,
        2,
        False,
        True,
    )
    checkpointing.configure(None)  # options start from the defaults again
    assert (SETTINGS.cpu_checkpointing, SETTINGS.num_checkpoints, SETTINGS.synchronize) == (False, None, False)
    checkpointing.set_num_layers(6)
    assert SETTINGS.num_checkpoints == 6


def test_configure_errors_name_the_fix():
    with pytest.raises(ConfigError, match="needs partition_activations=true"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ConfigError, match="needs number_checkpoints"):
        checkpointing.configure(
            None,
            deepspeed_config={
                "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True}
            },
        )
    with pytest.raises(ConfigError, match="did you mean 'activation_checkpointing.cpu_checkpointing'"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(TypeError, match="get_tensor_model_parallel_group"):
        checkpointing.configure(object(), partition_activations=True)
    checkpointing.configure(None, checkpoint_in_cpu=True)
    with pytest.raises(NotImplementedError, match="cpu_checkpointing"):
        checkpointing.non_reentrant_checkpoint(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(RuntimeError, match="incompatible with torch.autograd.grad"):
        x = torch.randn(2, 2, requires_grad=True)
        torch.autograd.grad(checkpointing.checkpoint(nn.Linear(2, 2), x).sum(), x)


def test_no_input_requiring_grad_warns_and_no_grad_stores_nothing():
    layer = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="no input tensor requires grad"):
        checkpointing.checkpoint(layer, torch.randn(2, 4))
    with torch.no_grad():
        saved, out = _saved(lambda: checkpointing.checkpoint(layer, torch.randn(2, 4)))
    assert saved == [] and not out.requires_grad


def test_synchronize_and_profile_act_at_each_boundary(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(Accelerator, "synchronize", lambda self, device_index=None: calls.append(1))
    checkpointing.configure(None, synchronize=True)
    checkpointing.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert len(calls) == 4  # start and end of forward and of backward
    checkpointing.configure(None, profile=True)
    with caplog.at_level(logging.INFO, logger="shardwise"):
        checkpointing.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert "activation checkpoint forward:" in caplog.text and "activation checkpoint backward:" in caplog.text


def test_model_parallel_seed_differs_across_tensor_ranks_only_inside_fork():
    draws = {}
    for rank in (0, 1):
        checkpointing.model_parallel_cuda_manual_seed(7, tensor_rank=rank)
        outside = torch.rand(4)
        with checkpointing.get_cuda_rng_tracker().fork():
            inside = torch.rand(4)
        draws[rank] = outside, inside
    assert torch.equal(draws[0][0], draws[1][0])
    assert not torch.equal(draws[0][1], draws[1][1])

    class Mpu:  # the older Megatron names; the rank comes from configure's mpu
        def get_model_parallel_group(self):
            return None

        def get_model_parallel_rank(self):
            return 1

        def get_model_parallel_world_size(self):
            return 1

    checkpointing.configure(Mpu())
    checkpointing.model_parallel_cuda_manual_seed(7)
    with checkpointing.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), draws[1][1])
