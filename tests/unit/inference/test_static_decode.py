"""The fixed-shape decode step that CUDA graphs replay ([Note: decode graphs]), run eagerly
on the CPU: the same tokens and logits as the plain model for every family, batch 1 and a
left-padded batch, a sliding window that binds, and a captured step reused by later calls
of the same shape. ``enable_cuda_graph=True`` where graphs cannot run is refused."""

import copy

import pytest
import torch

import shardwise
from shardwise.config import ConfigError
from shardwise.inference import _graphs
from shardwise.inference._graphs import StaticSteps
from shardwise.testing.causal_lm import FAMILIES, prompts, tiny_lm

NEW = 24


def _static_engine(reference):
    engine = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.fast_path and not engine.cuda_graph  # no graphs on the CPU
    engine._steps = StaticSteps(engine._decoder, graph=False)
    return engine


def _same_generation(reference, engine, ids, **kwargs):
    kwargs.update(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want, got = reference.generate(ids, **kwargs), engine.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_steps_generate_what_the_model_generates(family):
    reference = tiny_lm(family)
    engine = _static_engine(reference)
    single, (batch, mask) = prompts()
    _same_generation(reference, engine, single)
    _same_generation(reference, engine, batch, attention_mask=mask)
    other_single, (other, other_mask) = prompts(seed=5)  # same shapes: the kept steps are reused
    assert len(engine._steps._steps) == 2
    _same_generation(reference, engine, other_single)
    _same_generation(reference, engine, other, attention_mask=other_mask)
    assert len(engine._steps._steps) == 2


def test_static_steps_with_a_sliding_window_that_binds():
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=128,
        sliding_window=6,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    single, (batch, mask) = prompts()
    eager = shardwise.init_inference(copy.deepcopy(reference), dtype=torch.float32, replace_with_kernel_inject=True)
    assert eager._decoder.sliding_window == 6
    static = _static_engine(reference)
    for engine in (eager, static):
        _same_generation(reference, engine, single)
        _same_generation(reference, engine, batch, attention_mask=mask)


def test_kept_steps_are_bounded_and_reused():
    engine = _static_engine(tiny_lm("llama"))
    steps = engine._steps
    first = steps.get(1, 16)
    assert steps.get(1, 16) is first
    for length in range(17, 17 + _graphs._KEEP):
        steps.get(1, length)
    assert len(steps._steps) == _graphs._KEEP and (1, 16) not in steps._steps


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"replace_with_kernel_inject": True}, "needs a CUDA device"),
        ({}, "needs a CUDA device"),
    ],
)
def test_cuda_graph_required_where_it_cannot_run_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=f"enable_cuda_graph=True: it {message}"):
        shardwise.init_inference(tiny_lm("llama"), dtype=torch.float32, enable_cuda_graph=True, **kwargs)


def test_cuda_graph_off_or_unset_on_the_cpu():
    for value in (None, False):
        engine = shardwise.init_inference(
            tiny_lm("gpt2"), dtype=torch.float32, replace_with_kernel_inject=True, enable_cuda_graph=value
        )
        assert not engine.cuda_graph and engine._steps is None


def test_static_steps_with_a_shared_prefill():
    """A prompt's prefill shared by its group (GRPO) and then fixed-shape decode steps, as
    the hybrid engine runs them with ``enable_cuda_graph``: the tokens of the plain model."""
    from shardwise.inference._generate import fast_request, run_fast

    reference = tiny_lm("llama")
    engine = _static_engine(reference)
    ids = prompts()[0].repeat(2, 1)
    ids[1, 0] += 1  # two different prompts
    ids = ids.repeat_interleave(3, dim=0)
    kwargs = {"max_new_tokens": NEW, "do_sample": False}
    want = reference.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    request = fast_request(engine.module, (ids,), dict(kwargs))
    for _ in range(2):  # the second call replays the kept step
        got, _ = run_fast(engine._decoder, request, max_out_tokens=64, steps=engine._steps, shared_prefill=3)
        assert torch.equal(got, want)
