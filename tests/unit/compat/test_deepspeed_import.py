"""``import shardwise as deepspeed`` leaves the same submodules reachable as attributes as
DeepSpeed 0.19.8's ``import deepspeed`` does (the pipeline example calls
``deepspeed.runtime.utils.set_random_seed`` after a bare import), wherever shardwise has
the module; and it imports none of the optional extras. Also the small helpers that
DeepSpeed-Chat and the BERT examples import: ``recursive_getattr`` / ``recursive_setattr``,
``OnDevice``, the ``replace_policy`` names and the optimizer names of ``runtime.config``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise
from shardwise.compression.helper import recursive_getattr, recursive_setattr
from shardwise.module_inject import replace_policy
from shardwise.runtime.config import LAMB_OPTIMIZER, DeepSpeedConfig
from shardwise.tensor_parallel.policies import POLICIES

_LISTED = Path(__file__).with_name("deepspeed_import_reachable.txt").read_text().splitlines()
REACHABLE = [line.strip() for line in _LISTED if line.strip() and not line.startswith("#")]

_PROBE = """
import json, os, sys
paths = json.loads(sys.argv[1])
import shardwise
root = os.path.dirname(shardwise.__file__)
def has_file(path):
    base = os.path.join(root, *path.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))
def reachable(path):
    obj = shardwise
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj is not None
print(json.dumps({"missing": [p for p in paths if has_file(p) and not reachable(p)],
                  "offered": sum(has_file(p) for p in paths),
                  "extras": [m for m in ("transformers", "tensorboard", "wandb", "torch.utils.tensorboard")
                             if m in sys.modules]}))
"""


@pytest.fixture(scope="module")
def bare_import():
    """What a fresh interpreter sees after ``import shardwise`` and nothing else."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(REACHABLE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_deepspeeds_reachable_submodules_are_reachable_after_a_bare_import(bare_import):
    assert bare_import["missing"] == []
    assert bare_import["offered"] >= 50  # runtime.utils, runtime.pipe.*, ops.transformer, module_inject, ...


def test_a_bare_import_imports_no_optional_extras(bare_import):
    assert bare_import["extras"] == []


def test_recursive_getattr_and_setattr_swap_a_layer_by_name():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 1)))
    assert recursive_getattr(model, "1.1") is model[1][1]
    assert recursive_getattr(model, "1.1.weight") is model[1][1].weight
    replacement = nn.Linear(3, 1, bias=False)
    recursive_setattr(model, "1.1", replacement)
    assert model[1][1] is replacement and "1.1.weight" in dict(model.named_parameters())
    recursive_setattr(model, "extra", nn.Identity())  # a top-level name too
    assert isinstance(model.extra, nn.Identity)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "1.missing")


def test_on_device_builds_on_the_device_in_the_dtype_and_restores_both():
    before = torch.get_default_dtype()
    with shardwise.OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = nn.Linear(4, 4)
        counts = torch.zeros(3, dtype=torch.int64)
    assert layer.weight.is_meta and layer.weight.dtype == torch.bfloat16 and counts.dtype == torch.int64
    assert torch.get_default_dtype() == before and not torch.zeros(1).is_meta
    with shardwise.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta


def test_replace_policy_names_are_the_autotp_policies():
    assert replace_policy.HFGPT2LayerPolicy is POLICIES["gpt2"]
    assert replace_policy.HFOPTLayerPolicy is POLICIES["opt"]
    assert replace_policy.GPTNEOXLayerPolicy is POLICIES["gpt_neox"]
    assert replace_policy.LLAMALayerPolicy is replace_policy.LLAMA2LayerPolicy is POLICIES["llama"]
    assert replace_policy.HFGPT2LayerPolicy.kind("transformer.h.0.attn.c_proj") == "row"


def test_optimizer_names_are_what_the_config_accepts():
    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": LAMB_OPTIMIZER}})
    assert config.config.optimizer.type.lower() == "lamb"


class _FakeMpu:
    def get_data_parallel_world_size(self):
        return 2


def test_deepspeed_config_resolves_batches_over_the_mpus_data_parallel_size(one_rank_group):
    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, mpu=_FakeMpu())
    assert config.train_batch_size == 3 * 2 * 2
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3}).train_batch_size == 3  # the one-rank world
    with pytest.raises(ValueError, match="object has no get_data_parallel_world_size"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3}, mpu=object())
