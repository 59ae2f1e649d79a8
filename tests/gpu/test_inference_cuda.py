"""``init_inference`` on a CUDA GPU: the engine moves the model to the GPU and gives the
plain model's logits and greedy tokens (fp32, every family, the MoE ones included, with
and without kernel injection, batch 1 and a left-padded batch), bf16 logits close to the
fp32 model's, and weight-only int8. Skipped without a GPU."""

import copy

import pytest
import torch

import shardwise
from shardwise.testing.causal_lm import FAMILIES, MOE_FAMILIES, prompts, tiny_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 32


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "kernel_inject"])
@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)  # MoE: the captured step runs every expert
def test_engine_on_gpu_generates_what_the_model_generates(family, inject):
    reference = tiny_lm(family)
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=inject)
    reference = reference.cuda()
    assert all(p.is_cuda for p in engine.module.parameters())
    assert engine.cuda_graph == inject  # the fast path's decode steps replay as CUDA graphs by default
    single, (batch, mask) = prompts()
    single, batch, mask = single.cuda(), batch.cuda(), mask.cuda()
    with torch.no_grad():
        torch.testing.assert_close(
            engine(batch, attention_mask=mask).logits, reference(batch, attention_mask=mask).logits, rtol=0, atol=1e-4
        )
    other_single, (other, other_mask) = prompts(seed=5)  # same shapes: the captured graphs are replayed
    for ids, kwargs in (
        (single, {}),
        (batch, {"attention_mask": mask}),
        (other_single.cuda(), {}),
        (other.cuda(), {"attention_mask": other_mask.cuda()}),
    ):
        kwargs.update(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
        want, got = reference.generate(ids, **kwargs), engine.generate(ids, **kwargs)
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)
    assert 0 < engine.last_generation.time_to_first_token_s < engine.last_generation.total_s


def test_graphs_off_gives_the_same_tokens():
    reference = tiny_lm("llama")
    _, (batch, mask) = prompts()
    batch, mask = batch.cuda(), mask.cuda()
    outs = []
    for graphs in (False, True):
        engine = shardwise.init_inference(
            copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True, enable_cuda_graph=graphs
        )
        assert engine.cuda_graph == graphs
        outs.append(engine.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert torch.equal(*outs)
    with pytest.raises(shardwise.config.ConfigError, match="set replace_with_kernel_inject=True"):
        shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, enable_cuda_graph=True)


def _padded_logits(**options):
    """The fp32 model's and an engine's logits on the left-padded batch, the valid
    positions' mask, the engine and the batch (on the GPU)."""
    reference = tiny_lm("llama").cuda()
    engine = shardwise.init_inference(copy.deepcopy(reference), **options)
    _, (batch, mask) = prompts()
    batch, mask = batch.cuda(), mask.cuda()
    with torch.no_grad():
        want = reference(batch, attention_mask=mask).logits
        got = engine(batch, attention_mask=mask).logits.float()
    return want, got, mask.bool(), engine, (batch, mask)


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "kernel_inject"])
def test_bf16_engine_on_gpu_is_close_to_the_fp32_model(inject):
    want, got, valid, engine, _ = _padded_logits(dtype=torch.bfloat16, replace_with_kernel_inject=inject)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    error = (got - want)[valid].abs().max().item() / want[valid].abs().max().item()
    assert error < 0.03, error
    assert (got.argmax(-1) == want.argmax(-1))[valid].float().mean() > 0.95


def test_int8_weights_on_gpu():
    want, got, valid, engine, (batch, mask) = _padded_logits(dtype=torch.int8, replace_with_kernel_inject=True)
    assert (got.argmax(-1) == want.argmax(-1))[valid].float().mean() > 0.9
    tokens = engine.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert tokens.shape == (batch.shape[0], batch.shape[1] + 8) and tokens.is_cuda
