"""RandomLayerTokenDrop: forward and gradients equal running the layer on the kept tokens by
hand (gathered with Python indexing, the mask built from the kept positions, scattered back
with a loop), for both hidden-state orders; dropped tokens pass through; eval keeps all; a
transformers GPT-2 model, which passes its blocks the mask by position, trains converted."""

import math

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from shardwise.runtime.data_pipeline.data_routing import (
    RandomLayerTokenDrop,
    RandomLTD,
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)

BATCH, SEQ, WIDTH, KEPT = 3, 10, 16, 4
MASKED = -1e4  # finite, so a row with every key masked stays a number


class Block(nn.Module):
    """A small pre-LN causal block taking an additive [batch, 1, q, k] mask by keyword."""

    def __init__(self, *, seq_first=False):
        super().__init__()
        self.seq_first = seq_first
        self.ln = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x, attention_mask=None):
        if self.seq_first:
            x = x.transpose(0, 1)
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(WIDTH) + attention_mask[:, 0]
        x = x + self.proj(scores.softmax(-1) @ v)
        x = x + self.mlp(x)
        return x.transpose(0, 1) if self.seq_first else x


def _mask(positions, lengths):
    """Additive causal + right-padding mask for queries/keys at ``positions`` [batch, n]."""
    causal = positions[:, None, :] <= positions[:, :, None]
    real = positions < lengths[:, None]
    allowed = causal & real[:, None, :]
    return torch.where(allowed, 0.0, MASKED)[:, None]


def _gpt2():
    config = GPT2Config(n_embd=WIDTH, n_head=2, n_layer=1, n_positions=SEQ, resid_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    return GPT2Block(config, layer_idx=0)


def _reference(layer, hidden, indices, lengths, batch_first):
    """The layer on the kept tokens, by hand; returns the merged hidden states."""
    per_sample = hidden if batch_first else hidden.transpose(0, 1)
    part = torch.stack([per_sample[b, indices[b]] for b in range(BATCH)])
    out = layer(part if batch_first else part.transpose(0, 1), attention_mask=_mask(indices, lengths))
    out = out if batch_first else out.transpose(0, 1)
    merged = per_sample.clone()
    for b in range(BATCH):
        merged[b, indices[b]] = out[b]
    return merged if batch_first else merged.transpose(0, 1)


def _grads(layer, hidden, out, weights):
    layer.zero_grad()
    hidden.grad = None
    (out * weights).sum().backward()
    return [hidden.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize(
    "kind, order",
    [
        ("block", "batch_seq_dim"),
        ("block", "seq_batch_dim"),
        ("gpt2", "batch_seq_dim"),
        ("gpt2-positional", "batch_seq_dim"),
    ],
)
def test_forward_and_gradients_equal_the_hand_reference(kind, order):
    batch_first = order == "batch_seq_dim"
    torch.manual_seed(0)
    layer = _gpt2() if kind.startswith("gpt2") else Block(seq_first=not batch_first)
    wrapper = RandomLayerTokenDrop(layer, mask_name="attention_mask", hidden_state_order=order)
    wrapper.kept_length = KEPT
    shape = (BATCH, SEQ, WIDTH) if batch_first else (SEQ, BATCH, WIDTH)
    hidden = torch.randn(shape, requires_grad=True)
    weights = torch.randn(shape)
    lengths = torch.tensor([SEQ, 7, 5])
    full_mask = _mask(torch.arange(SEQ).expand(BATCH, SEQ), lengths)

    if kind == "gpt2-positional":  # as GPT2Model calls its blocks: (hidden, cache, mask)
        out = wrapper(hidden, None, full_mask)
    else:
        out = wrapper(hidden, attention_mask=full_mask)
    indices = wrapper.last_kept_indices
    assert indices.shape == (BATCH, KEPT)
    for row in indices.tolist():
        assert row == sorted(set(row)) and row[0] >= 0 and row[-1] < SEQ
    got = _grads(layer, hidden, out, weights)

    expected_out = _reference(layer, hidden, indices.sort(dim=1).values, lengths, batch_first)
    expected = _grads(layer, hidden, expected_out, weights)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-6)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_dropped_tokens_pass_through_with_identity_gradient():
    torch.manual_seed(1)
    wrapper = RandomLayerTokenDrop(Block(), mask_name="attention_mask")
    wrapper.kept_length = KEPT
    hidden = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    weights = torch.randn(BATCH, SEQ, WIDTH)
    out = wrapper(hidden, attention_mask=_mask(torch.arange(SEQ).expand(BATCH, SEQ), torch.full((BATCH,), SEQ)))
    (out * weights).sum().backward()
    dropped = torch.ones(BATCH, SEQ, dtype=torch.bool)
    dropped[torch.arange(BATCH)[:, None], wrapper.last_kept_indices] = False
    assert torch.equal(out[dropped], hidden[dropped])
    assert not torch.allclose(out[~dropped], hidden[~dropped])
    assert torch.equal(hidden.grad[dropped], weights[dropped])


def test_eval_none_or_full_length_run_every_token():
    torch.manual_seed(2)
    layer = Block()
    wrapper = RandomLayerTokenDrop(layer, mask_name="attention_mask")
    hidden = torch.randn(BATCH, SEQ, WIDTH)
    mask = _mask(torch.arange(SEQ).expand(BATCH, SEQ), torch.full((BATCH,), SEQ))
    full = layer(hidden, attention_mask=mask)
    for kept, training in [(None, True), (SEQ, True), (KEPT, False)]:
        wrapper.kept_length = kept
        wrapper.train(training)
        assert torch.equal(wrapper(hidden, attention_mask=mask), full)


class Pair(nn.Module):
    """Returns a tuple, like Hugging Face blocks of older versions."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, attention_mask):
        return self.linear(x) + attention_mask.sum(-1)[:, None, None], "extra"


def test_tuple_output_and_key_padding_mask():
    torch.manual_seed(3)
    wrapper = RandomLayerTokenDrop(Pair(), mask_name="attention_mask")
    wrapper.kept_length = KEPT
    hidden = torch.randn(BATCH, SEQ, WIDTH)
    key_mask = torch.arange(SEQ, dtype=torch.float).expand(BATCH, SEQ)
    out, extra = wrapper(hidden, attention_mask=key_mask)
    indices = wrapper.last_kept_indices
    assert extra == "extra"
    for b in range(BATCH):
        expected = wrapper.random_ltd_layer.linear(hidden[b, indices[b]]) + indices[b].float().sum()
        torch.testing.assert_close(out[b, indices[b]], expected)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x, mask):
        x = self.embed(x)
        for block in self.h:
            x = block(x, attention_mask=mask)
        return x


def test_state_dict_without_wrappers_loads_into_the_plain_model():
    torch.manual_seed(4)
    model = convert_to_random_ltd(Tiny(), Block)
    assert convert_to_random_ltd(model, Block) is model
    assert [type(m) for m in model.h] == [RandomLayerTokenDrop] * 3
    assert isinstance(model.h[0].random_ltd_layer, Block)
    assert any(".random_ltd_layer." in key for key in model.state_dict())
    plain = Tiny()
    plain.load_state_dict(save_without_random_ltd(model), strict=True)
    assert list(remove_random_ltd_state_dict(model.state_dict())) == list(plain.state_dict())
    x = torch.randn(BATCH, SEQ, WIDTH)
    mask = _mask(torch.arange(SEQ).expand(BATCH, SEQ), torch.full((BATCH,), SEQ))
    model.eval()
    torch.testing.assert_close(model(x, mask), plain(x, mask), rtol=0, atol=0)


def test_activation_checkpointing_recomputes_the_same_tokens():
    torch.manual_seed(5)
    layer = Block()
    wrapper = RandomLayerTokenDrop(layer, mask_name="attention_mask")
    wrapper.kept_length = KEPT
    hidden = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    mask = _mask(torch.arange(SEQ).expand(BATCH, SEQ), torch.full((BATCH,), SEQ))
    weights = torch.randn(BATCH, SEQ, WIDTH)
    results = []
    for recompute in (False, True):
        torch.manual_seed(6)
        if recompute:
            out = torch.utils.checkpoint.checkpoint(wrapper, hidden, attention_mask=mask, use_reentrant=False)
        else:
            out = wrapper(hidden, attention_mask=mask)
        results.append((out.detach(), _grads(layer, hidden, out, weights)))
    (plain, plain_grads), (ckpt, ckpt_grads) = results
    assert torch.equal(plain, ckpt)
    for a, b in zip(plain_grads, ckpt_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hugging_face_gpt2_model_trains_with_its_blocks_converted():
    torch.manual_seed(7)
    config = GPT2Config(n_embd=WIDTH, n_head=2, n_layer=3, n_positions=SEQ, vocab_size=32, resid_pdrop=0.0)
    config._attn_implementation = "eager"  # the model hands its blocks a 4-D mask, by position
    model = convert_to_random_ltd(GPT2LMHeadModel(config), GPT2Block)
    section = {
        "enabled": True,
        "total_layer_num": 3,
        "random_ltd_layer_num": 1,
        "random_ltd_layer_id": [1],
        "model_mask_name": "attention_mask",
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
            "min_value": KEPT,
            "max_value": SEQ,
            "schedule_config": {"require_steps": 9, "seq_per_step": 2},
        },
    }
    RandomLTD.from_config(section, model, global_batch_size=BATCH)
    seen = []
    model.transformer.h[1].random_ltd_layer.register_forward_hook(lambda m, args, out: seen.append(args[2].shape))
    ids = torch.randint(32, (BATCH, SEQ))
    padding = (torch.arange(SEQ) < torch.tensor([[SEQ], [7], [5]])).long()
    loss = model(input_ids=ids, attention_mask=padding, labels=ids).loss
    loss.backward()
    assert seen == [(BATCH, 1, KEPT, KEPT)] and torch.isfinite(loss)
    assert model.transformer.h[1].random_ltd_layer.attn.c_attn.weight.grad.abs().sum() > 0


def test_llama_layer_gets_the_kept_tokens_rotary_positions():
    torch.manual_seed(8)
    config = LlamaConfig(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=1, vocab_size=32, max_position_embeddings=SEQ,
    )  # fmt: skip
    config._attn_implementation = "eager"
    layer, rope = LlamaDecoderLayer(config, layer_idx=0), LlamaRotaryEmbedding(config)
    token_kwargs = ("position_embeddings", "position_ids")
    wrapper = RandomLayerTokenDrop(layer, mask_name="attention_mask", token_kwargs=token_kwargs)
    wrapper.kept_length = KEPT
    hidden = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)
    weights = torch.randn(BATCH, SEQ, WIDTH)
    lengths = torch.tensor([SEQ, 7, 5])
    positions = torch.arange(SEQ)[None]  # [1, seq], as LlamaModel builds them
    out = wrapper(
        hidden,
        attention_mask=_mask(positions.expand(BATCH, SEQ), lengths),
        position_embeddings=rope(hidden, positions),
        position_ids=positions,
    )
    got = _grads(layer, hidden, out, weights)
    kept = wrapper.last_kept_indices
    part = torch.stack([hidden[b, kept[b]] for b in range(BATCH)])
    part_out = layer(part, attention_mask=_mask(kept, lengths), position_embeddings=rope(part, kept), position_ids=kept)
    expected_out = hidden.clone()
    for b in range(BATCH):
        expected_out[b, kept[b]] = part_out[b]
    expected = _grads(layer, hidden, expected_out, weights)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-6)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
