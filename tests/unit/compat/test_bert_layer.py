"""DeepSpeed's fused BERT layer (``DeepSpeedTransformerLayer``) against a hand-written
BERT layer built from the same weights, pre- and post-LN, with a padding mask; and
DeepSpeed's configuration defaults and checkpoint names (read from DeepSpeed 0.19.8's
``ops/transformer/transformer.py``)."""

import math

import pytest
import torch

from shardwise.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

# DeepSpeed 0.19.8: names and shapes of DeepSpeedTransformerLayer's parameters (H hidden, I intermediate)
DEEPSPEED_PARAMS = {
    "attn_qkvw": ("3H", "H"),
    "attn_qkvb": ("3H",),
    "attn_ow": ("H", "H"),
    "attn_ob": ("H",),
    "attn_nw": ("H",),
    "attn_nb": ("H",),
    "inter_w": ("I", "H"),
    "inter_b": ("I",),
    "output_w": ("H", "I"),
    "output_b": ("H",),
    "norm_w": ("H",),
    "norm_b": ("H",),
}
# DeepSpeed 0.19.8: DeepSpeedTransformerConfig's arguments, in order, with their defaults
DEEPSPEED_CONFIG_DEFAULTS = [
    ("batch_size", -1),
    ("hidden_size", -1),
    ("intermediate_size", -1),
    ("heads", -1),
    ("attn_dropout_ratio", -1),
    ("hidden_dropout_ratio", -1),
    ("num_hidden_layers", -1),
    ("initializer_range", -1),
    ("layer_norm_eps", 1e-12),
    ("local_rank", -1),
    ("seed", -1),
    ("fp16", False),
    ("pre_layer_norm", True),
    ("normalize_invertible", False),
    ("gelu_checkpoint", False),
    ("adjust_init_range", True),
    ("attn_dropout_checkpoint", False),
    ("stochastic_mode", False),
    ("return_tuple", False),
    ("training", True),
]

HIDDEN, HEADS, INTER, BATCH, SEQ = 16, 4, 24, 2, 5


def _config(**overrides):
    values = dict(
        batch_size=BATCH,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        heads=HEADS,
        attn_dropout_ratio=0.1,
        hidden_dropout_ratio=0.1,
        num_hidden_layers=2,
        initializer_range=0.02,
    )
    return DeepSpeedTransformerConfig(**{**values, **overrides})


def _reference_bert_layer(x, mask, w, *, pre_layer_norm, eps=1e-12):
    """BERT's layer written out: separate query/key/value projections, an explicit
    softmax over masked scores, GELU (tanh form, as DeepSpeed's kernel) and the two norms."""

    def norm(t, name):
        mean = t.mean(-1, keepdim=True)
        var = ((t - mean) ** 2).mean(-1, keepdim=True)
        return (t - mean) / torch.sqrt(var + eps) * w[name + "w"] + w[name + "b"]

    def self_attention(t):
        q_w, k_w, v_w = w["attn_qkvw"].chunk(3)
        q_b, k_b, v_b = w["attn_qkvb"].chunk(3)
        d = HIDDEN // HEADS
        heads = [
            (t @ m.T + b).view(BATCH, SEQ, HEADS, d).transpose(1, 2) for m, b in ((q_w, q_b), (k_w, k_b), (v_w, v_b))
        ]
        scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(d) + mask
        context = torch.softmax(scores, dim=-1) @ heads[2]
        return context.transpose(1, 2).reshape(BATCH, SEQ, HIDDEN) @ w["attn_ow"].T + w["attn_ob"]

    def feed_forward(t):
        inner = t @ w["inter_w"].T + w["inter_b"]
        inner = 0.5 * inner * (1 + torch.tanh(math.sqrt(2 / math.pi) * (inner + 0.044715 * inner**3)))
        return inner @ w["output_w"].T + w["output_b"]

    if pre_layer_norm:
        attended = x + self_attention(norm(x, "norm_"))
        return attended + feed_forward(norm(attended, "attn_n"))
    attended = norm(x + self_attention(x), "attn_n")
    return norm(attended + feed_forward(attended), "norm_")


def _padding_mask():
    """BERT's extended attention mask: the second sequence's last two tokens are padding."""
    keep = torch.ones(BATCH, SEQ, dtype=torch.float64)
    keep[1, -2:] = 0
    return (1.0 - keep)[:, None, None, :] * -10000.0


@pytest.mark.parametrize("pre_layer_norm", [True, False], ids=["pre-LN", "post-LN"])
def test_matches_a_hand_written_bert_layer(pre_layer_norm):
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(_config(pre_layer_norm=pre_layer_norm)).double().eval()
    with torch.no_grad():  # non-trivial norms and biases, so each is checked in its place
        for param in layer.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    mask = _padding_mask()
    weights = {name: p.detach() for name, p in layer.named_parameters()}
    expected = _reference_bert_layer(x, mask, weights, pre_layer_norm=pre_layer_norm)
    torch.testing.assert_close(layer(x, mask), expected, rtol=1e-10, atol=1e-10)
    unmasked = layer(x, None)  # the mask matters: padding changes the other tokens' outputs
    assert (unmasked[1] - expected[1]).abs().max() > 1e-3


def test_gradients_match_the_reference():
    torch.manual_seed(1)
    layer = DeepSpeedTransformerLayer(_config(pre_layer_norm=True)).double().eval()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    layer(x, _padding_mask()).square().sum().backward()
    weights = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    _reference_bert_layer(x_ref, _padding_mask(), weights, pre_layer_norm=True).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-9)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, weights[name].grad, rtol=1e-9, atol=1e-9, msg=name)


def test_a_state_dict_with_deepspeeds_names_loads():
    layer = DeepSpeedTransformerLayer(_config())
    sizes = {"H": HIDDEN, "3H": 3 * HIDDEN, "I": INTER}
    state = {name: torch.randn(*(sizes[s] for s in shape)) for name, shape in DEEPSPEED_PARAMS.items()}
    layer.load_state_dict(state, strict=True)
    assert list(layer.state_dict()) == list(DEEPSPEED_PARAMS)
    assert all(torch.equal(layer.state_dict()[name], state[name]) for name in DEEPSPEED_PARAMS)


def test_config_has_deepspeeds_arguments_order_and_defaults():
    config = DeepSpeedTransformerConfig()
    assert [(name, getattr(config, name)) for name, _ in DEEPSPEED_CONFIG_DEFAULTS] == DEEPSPEED_CONFIG_DEFAULTS
    positional = DeepSpeedTransformerConfig(*[value for _, value in DEEPSPEED_CONFIG_DEFAULTS[:8]])
    assert positional == config
    assert DeepSpeedTransformerConfig(hidden_size=8).intermediate_size == 32  # unset: 4 x hidden


def test_init_follows_initializer_range_and_adjust_init_range():
    torch.manual_seed(0)
    wide = DeepSpeedTransformerConfig(hidden_size=256, heads=4, num_hidden_layers=8, initializer_range=0.05)
    layer = DeepSpeedTransformerLayer(wide)
    assert layer.attn_qkvw.std().item() == pytest.approx(0.05, rel=0.05)
    assert layer.attn_ow.std().item() == pytest.approx(0.05 / 4, rel=0.05)  # / sqrt(2 * 8)
    assert torch.equal(layer.norm_w, torch.ones(256)) and torch.equal(layer.attn_qkvb, torch.zeros(768))


def test_dropout_follows_train_and_eval_and_return_tuple():
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(_config(return_tuple=True, hidden_dropout_ratio=0.5))
    x = torch.randn(BATCH, SEQ, HIDDEN)
    out = layer(x)
    assert isinstance(out, tuple) and len(out) == 1
    assert not torch.equal(out[0], layer(x)[0])  # training: dropout draws differ
    layer.eval()
    assert torch.equal(layer(x)[0], layer(x)[0])


def test_unsupported_arguments_are_refused_by_name():
    layer = DeepSpeedTransformerLayer(_config())
    with pytest.raises(NotImplementedError, match="past_key_value"):
        layer(torch.zeros(BATCH, SEQ, HIDDEN), past_key_value=(1, 2))
    with pytest.raises(ValueError, match="hidden_size \\(10\\) must be a positive multiple of heads \\(4\\)"):
        DeepSpeedTransformerLayer(_config(hidden_size=10))
