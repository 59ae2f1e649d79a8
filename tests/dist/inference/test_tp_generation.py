"""Tensor-parallel inference on 2 and 4 gloo ranks: for every family with a built-in
policy, the engine's logits equal the plain model's (fp32, 1e-4), its greedy tokens are
identical over 32 new tokens (batch 1 and a left-padded batch, with and without kernel
injection), sampling with a seed draws the plain model's tokens, and each rank holds only
its slice of every split layer and of the LM head. On 4 ranks (tp 4: one key-value head per
rank) every family checks its slices, its logits and the left-padded greedy batch, which
read every rank's slice and its KV cache; batch 1 and sampling, which differ from the batch
only after the logits are gathered, are checked at tp 2. On 4 ranks tp 2 forms two tensor
groups; a tensor group can also be given as a process group."""

import copy

import pytest
import torch

from shardwise.testing import run_distributed
from shardwise.testing.causal_lm import FAMILIES, VOCAB, prompts, tiny_lm

NEW = 32


def _split_layers(family: str) -> tuple[str, str]:
    """A column-parallel and a row-parallel layer of the family's first block."""
    return {
        "llama": ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"),
        "mistral": ("model.layers.0.mlp.up_proj", "model.layers.0.self_attn.o_proj"),
        "qwen2": ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj"),
        "gpt2": ("transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_proj"),
        "opt": ("model.decoder.layers.0.fc1", "model.decoder.layers.0.fc2"),
        "gpt_neox": ("gpt_neox.layers.0.mlp.dense_h_to_4h", "gpt_neox.layers.0.attention.dense"),
    }[family]


def _check_split(engine, reference, family: str, rank: int, tp: int) -> None:
    column, row = _split_layers(family)
    for name, dim in ((column, 0), (row, 1)):
        full = reference.get_submodule(name).weight
        if type(reference.get_submodule(name)).__name__ == "Conv1D":
            full = full.t()
        held = engine.module.get_submodule(name).weight
        assert held.shape[dim] * tp == full.shape[dim], (name, held.shape, full.shape)
        assert torch.equal(held, full.chunk(tp, dim=dim)[rank]), name
    head = engine.module.get_output_embeddings().weight
    assert head.shape[0] * tp == VOCAB
    assert torch.equal(head, reference.get_output_embeddings().weight.chunk(tp, dim=0)[rank])


def _reference_outputs(reference, single, batch, mask) -> dict:
    """The plain model's logits, greedy generations and seeded sample."""
    with torch.no_grad():
        outputs = {"logits": reference(batch, attention_mask=mask).logits}
    for name, ids, kwargs in (("single", single, {}), ("batch", batch, {"attention_mask": mask})):
        outputs[name] = reference.generate(
            ids, **kwargs, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
    torch.manual_seed(7)
    outputs["sampled"] = reference.generate(
        batch, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=20, temperature=0.9
    )
    return outputs


@pytest.fixture(scope="module")
def plain_outputs():
    """``_reference_outputs`` of every family, computed once in this process for every rank
    and world size (on one thread, as a rank computes; the global RNG is left as it was)."""
    single, (batch, mask) = prompts()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            return {family: _reference_outputs(tiny_lm(family), single, batch, mask) for family in FAMILIES}
    finally:
        torch.set_num_threads(threads)


def _body(rank, world_size, plain_outputs):
    import shardwise

    single, (batch, mask) = prompts()
    report = {}
    for family in FAMILIES:
        wanted = plain_outputs[family]
        for inject in _injections(family, world_size):
            reference = tiny_lm(family)  # seeded: the weights the plain outputs came from
            engine = shardwise.init_inference(
                copy.deepcopy(reference),
                dtype=torch.float32,
                tensor_parallel={"tp_size": world_size},
                replace_with_kernel_inject=inject,
            )
            assert engine.mp_world_size == world_size
            _check_split(engine, reference, family, rank, world_size)
            got = engine(batch, attention_mask=mask).logits
            logit_err = (got - wanted["logits"])[mask.bool()].abs().max().item()
            assert logit_err < 1e-4, (family, inject, logit_err)
            generations = [("batch", batch, {"attention_mask": mask})]
            if world_size == 2:
                generations.insert(0, ("single", single, {}))
            for name, ids, kwargs in generations:
                kwargs.update(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
                want, got = wanted[name], engine.generate(ids, **kwargs)
                assert torch.equal(got.sequences, want.sequences), (family, inject, ids.shape)
                step_err = (torch.stack(got.logits) - torch.stack(want.logits)).abs().max().item()
                assert step_err < 1e-4, (family, inject, step_err)
            if world_size == 2:
                torch.manual_seed(7)
                got = engine.generate(
                    batch, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=20, temperature=0.9
                )
                assert torch.equal(got, wanted["sampled"]), (family, inject, "sampling")
            report[(family, inject)] = (logit_err, engine.fast_path)
    if world_size == 4:  # tp 2 in a world of 4: two tensor groups, {0, 1} and {2, 3}, each a whole model
        reference = tiny_lm("llama")
        engine = shardwise.init_inference(
            copy.deepcopy(reference),
            dtype=torch.float32,
            tensor_parallel={"tp_size": 2},
            replace_with_kernel_inject=True,
        )
        _check_split(engine, reference, "llama", rank % 2, 2)
        kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(engine.generate(batch, **kwargs), plain_outputs["llama"]["batch"].sequences)
        return report, engine.mp_world_size
    return report, None


_TP4_FAST = {"mistral", "gpt2", "opt", "gpt_neox"}
"""The families generating on the fast path at tp 4; Llama and Qwen2 run there on their own
modules (AutoTP), so every family and both paths are split four ways at half the cost of
both paths for every family (which tp 2 runs)."""


def _injections(family, world_size):
    """``replace_with_kernel_inject`` values to run ``family`` with."""
    return (False, True) if world_size == 2 else (family in _TP4_FAST,)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_generation_equals_plain_model(tmp_path, plain_outputs, world_size):
    reports = run_distributed(
        _body, world_size=world_size, tmp_path=tmp_path, timeout_s=600, plain_outputs=plain_outputs
    )
    assert [tp for _, tp in reports] == [2 if world_size == 4 else None] * world_size
    fast = {family for (family, inject), (_, on) in reports[0][0].items() if inject and on}
    assert fast == {family for family in FAMILIES if True in _injections(family, world_size)}
    assert len(reports[0][0]) == sum(len(_injections(family, world_size)) for family in FAMILIES)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in = torch.nn.Linear(16, 32)
        self.fc_out = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _llama(**overrides):
    import transformers

    torch.manual_seed(0)
    options = dict(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    options.update(overrides)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**options))


def _policy_int8_and_errors_body(rank, world_size):
    import shardwise

    # injection_policy on a model no built-in policy knows: fc_out reduced, fc_in split
    reference = _Net()
    engine = shardwise.init_inference(
        copy.deepcopy(reference),
        dtype=torch.float32,
        tensor_parallel={"tp_size": 2},
        injection_policy={_Block: ("fc_out",)},
    )
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(engine(x), reference(x), rtol=0, atol=1e-5)
    held = engine.module.blocks[0]
    assert torch.equal(held.fc_in.weight, reference.blocks[0].fc_in.weight.chunk(2, dim=0)[rank])
    assert torch.equal(held.fc_out.weight, reference.blocks[0].fc_out.weight.chunk(2, dim=1)[rank])
    # the tensor group given as a process group (tensor_parallel.tp_group), and one that disagrees with tp_size
    group = torch.distributed.new_group([0, 1])
    reference = tiny_lm("gpt2")
    engine = shardwise.init_inference(
        copy.deepcopy(reference), dtype=torch.float32, tensor_parallel={"tp_group": group, "tp_size": 2}
    )
    _check_split(engine, reference, "gpt2", rank, 2)
    errors = {}
    try:
        shardwise.init_inference(
            tiny_lm("gpt2"), dtype=torch.float32, tensor_parallel={"tp_group": group, "tp_size": 4}
        )
    except ValueError as exc:
        errors["group size"] = str(exc)
    for name, build, kwargs in (
        ("no policy", _Net, {}),
        ("policy names no class", _Net, {"injection_policy": {"Nope": ("fc_out",)}}),
        ("heads", lambda: _llama(num_attention_heads=3, num_key_value_heads=3), {}),
        ("kv heads", lambda: _llama(num_key_value_heads=1), {}),
        ("vocab", lambda: _llama(vocab_size=127), {}),
    ):
        try:
            shardwise.init_inference(build(), dtype=torch.float32, tensor_parallel={"tp_size": 2}, **kwargs)
        except ValueError as exc:
            errors[name] = str(exc)
    # int8 shards: each rank quantises its own slice
    reference = tiny_lm("llama")
    engine = shardwise.init_inference(
        copy.deepcopy(reference), dtype=torch.int8, replace_with_kernel_inject=True, tensor_parallel={"tp_size": 2}
    )
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits
    got = engine(ids).logits
    int8 = (
        (got - want).abs().max().item() / want.abs().max().item(),
        (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        engine.module.model.layers[0].self_attn.q_proj.parametrizations.weight.original.shape,
    )
    return errors, int8


def test_injection_policy_int8_and_bad_splits_on_two_ranks(tmp_path):
    errors, int8 = run_distributed(_policy_int8_and_errors_body, world_size=2, tmp_path=tmp_path, timeout_s=300)[0]
    assert "no tensor-parallel policy for _Net" in errors["no policy"] and "_Block" in errors["no policy"]
    assert "injection_policy=" in errors["no policy"]
    assert "no module of those classes" in errors["policy names no class"]
    assert "does not divide the attention heads (num_attention_heads) = 3" in errors["heads"]
    assert "does not divide the key-value heads (num_key_value_heads) = 1" in errors["kv heads"]
    assert "does not divide the vocabulary (vocab_size) = 127" in errors["vocab"]
    assert "tp_size is 4 but the tensor-parallel group given has 2 ranks" in errors["group size"]
    relative_error, top1, shard_shape = int8
    assert relative_error <= 0.1 and top1 >= 0.9
    assert tuple(shard_shape) == (32, 64)  # half of q_proj's 64 output rows, stored as int8
