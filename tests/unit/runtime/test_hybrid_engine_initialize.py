"""``initialize`` with ``hybrid_engine`` in a world of one: the hybrid engine when enabled
(``engine.module.generate`` goes through it, and copying the module leaves the engine
behind), the plain engine otherwise, and what it cannot run refused by name."""

import copy

import pytest
import torch

import shardwise
from shardwise.config import ConfigError
from shardwise.testing.causal_lm import tiny_lm

pytest.importorskip("transformers")


def _initialize(model, **hybrid):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if hybrid:
        config["hybrid_engine"] = hybrid
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    return engine


def test_enabled_gives_the_hybrid_engine_and_module_generate_goes_through_it():
    model = tiny_lm("llama")
    engine = _initialize(model, enabled=True, max_out_tokens=8)
    assert isinstance(engine, shardwise.HybridEngine)
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="hybrid_engine.max_out_tokens=8"):
        engine.module.generate(prompt, max_new_tokens=6)
    assert engine.module.generate(prompt, max_new_tokens=5, do_sample=False).shape == (1, 8)
    assert isinstance(copy.deepcopy(engine.module), type(model))


def test_disabled_gives_the_training_engine():
    engine = _initialize(tiny_lm("llama"), enabled=False)
    assert type(engine) is shardwise.Engine and "generate" not in vars(engine.module)


def test_inference_tp_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"inference_tp_size=2 does not divide the 1 rank"):
        _initialize(tiny_lm("llama"), enabled=True, inference_tp_size=2)


def test_cuda_graph_on_the_cpu_is_refused():
    with pytest.raises(ConfigError, match="enable_cuda_graph=true: it needs a CUDA device and this engine runs on cpu"):
        _initialize(tiny_lm("llama"), enabled=True, enable_cuda_graph=True)


def test_shared_prefill_through_the_engine():
    engine = _initialize(tiny_lm("llama"), enabled=True)
    rows = torch.tensor([[5, 6, 7], [9, 10, 11]]).repeat_interleave(2, dim=0)
    plain = engine.generate(rows, max_new_tokens=3, do_sample=False)
    engine.prepare_shared_prefill(2, 2, 3)
    assert torch.equal(engine.module.generate(rows, max_new_tokens=3, do_sample=False), plain)
    keys, _ = engine.repeat_shared_prefill_cache(2, 2)[1]
    assert keys.shape[0] == 4 and keys.shape[2] == 3
    with pytest.raises(ValueError, match="must be positive"):
        engine.prepare_shared_prefill(2, 0, 3)
