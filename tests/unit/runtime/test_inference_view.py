"""The hybrid engine's inference view in one process (no ZeRO): it follows in-place
changes of the weights (fused biases included), falls back to the model's own generate
for a family without a fast decoder (logged once), refuses a generation longer than
max_out_tokens, frees what pin_parameters / release_inference_cache say, and fills the
copy in groups of tp_gather_partition_size layers."""

import contextlib
import logging

import pytest
import torch

from shardwise.config._hybrid_engine import HybridEngineConfig
from shardwise.runtime._inference_view import InferenceView, SharedPrefill, gather_plan
from shardwise.testing.causal_lm import VOCAB, tiny_lm

transformers = pytest.importorskip("transformers")

PROMPT = torch.tensor([[5, 17, 40, 9], [77, 3, 12, 100]])


def _view(model, **config):
    return InferenceView(model, config=HybridEngineConfig(enabled=True, **config), keep_whole=contextlib.nullcontext)


def _own(model, **kwargs):
    return type(model).generate(model, PROMPT, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", ["qwen2", "opt", "gpt2", "gpt_neox"])
def test_generation_follows_in_place_weight_changes(family):
    model = tiny_lm(family)
    view = _view(model)
    out = view.generate((PROMPT,), {"max_new_tokens": 6, "do_sample": False})
    assert torch.equal(out, _own(model, max_new_tokens=6))
    assert view.no_fast_path is None
    with torch.no_grad():  # what an optimizer step does: new values, same tensors
        for name, param in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                param.add_(torch.randn_like(param) * (0.5 if name.endswith("bias") else 0.1))
    out = view.generate((PROMPT,), {"max_new_tokens": 6, "do_sample": False})
    assert torch.equal(out, _own(model, max_new_tokens=6))


def test_a_family_without_fast_decoder_runs_its_own_generate_logged_once(caplog):
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).eval()
    view = _view(model)
    with caplog.at_level(logging.INFO, logger="shardwise"):
        for _ in range(2):
            out = view.generate((PROMPT,), {"max_new_tokens": 4, "do_sample": False})
            assert torch.equal(out, _own(model, max_new_tokens=4))
    notes = [r.getMessage() for r in caplog.records if "own generate" in r.getMessage()]
    assert len(notes) == 1 and "'bloom'" in notes[0]


def test_arguments_the_fast_loop_does_not_serve_run_generate_on_the_copy(caplog):
    model = tiny_lm("llama")
    view = _view(model)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "repetition_penalty": 1.5}
    with caplog.at_level(logging.INFO, logger="shardwise"):
        out = view.generate((PROMPT,), kwargs)
    assert torch.equal(out, _own(model, max_new_tokens=5, repetition_penalty=1.5))
    assert view.memory().weights_bytes > 0  # the copy generated, not the training module
    assert any("repetition_penalty" in r.getMessage() for r in caplog.records)


class _NoConfigLM(torch.nn.Module):
    """A model with its own generate and no config to build a copy from."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_lm("llama")

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)


def test_a_model_that_cannot_be_copied_generates_on_the_training_module():
    model = _NoConfigLM()
    view = _view(model)
    out = view.generate((PROMPT,), {"max_new_tokens": 4, "do_sample": False})
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=4, do_sample=False))
    assert view.memory().weights_bytes == 0


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_max_out_tokens_is_refused_before_generating(family):
    if family == "bloom":
        model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1))
    else:
        model = tiny_lm(family)
    view = _view(model, max_out_tokens=10)
    with pytest.raises(ValueError, match=r"reach 11 tokens \(4 prompt \+ 7 new\).*hybrid_engine.max_out_tokens=10"):
        view.generate((PROMPT,), {"max_new_tokens": 7})
    view.generate((PROMPT,), {"max_new_tokens": 6, "do_sample": False})


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("release", [True, False])
def test_pin_parameters_and_release_inference_cache_free_what_they_say(pin, release):
    model = tiny_lm("llama")
    view = _view(model, pin_parameters=pin, release_inference_cache=release)
    out = view.generate((PROMPT,), {"max_new_tokens": 3, "do_sample": False})
    held = view.memory()
    assert (held.weights_bytes > 0) == pin
    assert (held.cache_bytes > 0) == (pin and not release)
    assert torch.equal(view.generate((PROMPT,), {"max_new_tokens": 3, "do_sample": False}), out)


@pytest.mark.parametrize("layers_per_group,num_groups", [(1, 3), (2, 2), (8, 2)])
def test_gather_plan_takes_every_parameter_once_in_layer_groups(layers_per_group, num_groups):
    model = tiny_lm("llama")
    groups = gather_plan(model, layers_per_group)
    assert len(groups) == num_groups
    names = [name for group in groups for name, _ in group.params]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert all(name.startswith("model.layers.") for group in groups[1:] for name, _ in group.params)


class _CountingForward:
    """Records the batch size of every decoder forward."""

    def __init__(self, forward):
        self.forward, self.batches = forward, []

    def __call__(self, ids, *args):
        self.batches.append(ids.shape[0])
        return self.forward(ids, *args)


@pytest.mark.parametrize("padded", [False, True])
def test_shared_prefill_runs_each_prompt_once_and_generates_as_the_repeated_batch(padded):
    model = tiny_lm("llama")
    prompts = torch.tensor([[5, 17, 40, 9, 31], [77, 3, 12, 100, 64]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]) if padded else torch.ones_like(prompts)
    rows, row_mask = prompts.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0)
    kwargs = {"attention_mask": row_mask, "max_new_tokens": 5, "do_sample": False}
    plain = _view(model).generate((rows,), kwargs)
    view = _view(model)
    view.generate((rows,), kwargs)  # builds the decoder
    counting = view._decoder.decoder.forward = _CountingForward(view._decoder.decoder.forward)
    view.share_next_prefill(SharedPrefill(2, 3, 5))
    assert torch.equal(view.generate((rows,), kwargs), plain)
    assert counting.batches == [2] + [6] * 4  # the prompt once per group, then every row decodes
    keys, values = view.shared_prompt_cache(2, 3)[0]
    assert keys.shape[:3] == (6, model.config.num_key_value_heads, 5)
    assert torch.equal(keys[3:6], keys[3:4].expand(3, -1, -1, -1)) and not torch.equal(keys[0], keys[3])
    with pytest.raises(RuntimeError, match=r"the last generate ran no shared prefill"):
        view.shared_prompt_cache(3, 2)
    view.generate((rows,), kwargs)  # a later generate shares nothing unless asked again
    assert counting.batches[5] == 6


def test_shared_prefill_refuses_rows_that_are_not_groups_of_one_prompt():
    view = _view(tiny_lm("llama"))
    view.share_next_prefill(SharedPrefill(2, 2, 4))
    with pytest.raises(ValueError, match=r"not groups of 2 identical prompts"):
        view.generate((PROMPT.repeat(2, 1),), {"max_new_tokens": 2})
    view.share_next_prefill(SharedPrefill(2, 3, 4))
    with pytest.raises(ValueError, match=r"expects input ids of shape \[6, 4\], got \[4, 4\]"):
        view.generate((PROMPT.repeat_interleave(2, dim=0),), {"max_new_tokens": 2})
