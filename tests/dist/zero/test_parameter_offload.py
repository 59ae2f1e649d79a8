"""DeepSpeed's ``engine.optimizer.parameter_offload`` under stage 3, used as TRL uses it
around generation (``remove_hooks`` / ``add_hooks`` in ``trl/models/utils.py``, repeated
here without TRL): every parameter gathered, the forward hooks removed, greedy
``generate``, the module registered again. The tokens are the plain model's, each unit is
gathered once for the whole generation (not once per token), and nothing stays gathered."""

import copy

import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.causal_lm import VOCAB, tiny_lm
from shardwise.testing.parity import STAGE3_PARTITION_ALL


def _body(rank, world_size):
    model = tiny_lm("llama")
    plain = copy.deepcopy(model)
    engine, *_ = shardwise.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
        },
    )
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))
    expected = plain.generate(prompt, max_new_tokens=8, do_sample=False)
    offload = engine.optimizer.parameter_offload
    issued = sum(engine.comm.calls.values())
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        for param in offload.module.named_parameters(recurse=True):
            param[1].ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        out = engine.module.generate(prompt, max_new_tokens=8, do_sample=False)
        if not offload.param_coordinator.is_invalid_trace():
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    gathers = sum(engine.comm.calls.values()) - issued
    whole = [n for n, p in engine.module.named_parameters() if p.numel()]
    return out.tolist() == expected.tolist(), gathers, len(engine.strategy.buckets), whole


def test_trl_style_generation_gathers_each_unit_once(tmp_path):
    for same, gathers, units, whole in run_distributed(_body, world_size=2, tmp_path=tmp_path):
        assert same, "generate with the hooks removed gives the plain model's tokens"
        assert gathers == units, (gathers, units)
        assert whole == [], whole
