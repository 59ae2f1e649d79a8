"""ZeroQuant: group-wise integer weights, layer-by-layer distillation, int8 kernels in
init_inference."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.compression import init_compression, layer_by_layer_distillation, zeroquant
from shardwise.config import ConfigError
from shardwise.inference._int8_kernels import int_weight

LINEARS = r"blocks\.\d+\.(qkv|proj|fc|out)$"


class Block(nn.Module):
    """The demo GPT's layer names (``examples/gpt_model.py``); causal attention is
    replaced by a running mean, and ``gain`` shows that keyword arguments reach blocks."""

    def __init__(self, width):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, *, gain=1.0):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        mixed = (v * torch.sigmoid(q * k)).cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
        x = x + gain * self.proj(mixed)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, *, vocab=64, width=32, layers=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok_emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, gain=0.5)
        return self.head(self.ln_f(x))


def zq_config(bits, group_size, *, shared=None, params=None):
    wq_shared = {"enabled": True, "quantize_weight_in_forward": True, "quantize_group_size": group_size}
    wq_shared.update(shared or {})
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": wq_shared,
                "different_groups": {
                    "w": {"params": {"start_bits": bits, "target_bits": bits, **(params or {})}, "modules": [LINEARS]}
                },
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {"a": {"params": {"bits": 8}, "modules": [LINEARS]}},
            },
        }
    }


def calibration(n=2, vocab=64):
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (2, 12), generator=gen) for _ in range(n)]


@pytest.mark.parametrize("bits, group, in_features", [(8, 512, 1024), (4, 32, 64)])
def test_integer_weights_take_exactly_two_to_the_bits_levels_per_group(bits, group, in_features):
    layer_model = nn.ModuleDict({"blocks": nn.ModuleList([nn.ModuleDict({"fc": nn.Linear(in_features, 3)})])})
    gen = torch.Generator().manual_seed(0)
    groups = 3 * in_features // group
    spread = torch.rand(groups, 1, generator=gen) + 0.5
    values = torch.linspace(-1, 1, group).repeat(groups, 1) * spread
    values = values.gather(1, torch.rand(groups, group, generator=gen).argsort(dim=1))  # shuffled in each group
    with torch.no_grad():
        layer_model.blocks[0].fc.weight.copy_(values.reshape(3, in_features))
    init_compression(layer_model, zq_config(bits, group))
    layer = layer_model.blocks[0].fc
    q, scale = int_weight(layer)  # [groups per row, rows, columns]
    per_group = q.permute(1, 0, 2).reshape(groups, group)
    for g in range(groups):
        levels = per_group[g].unique()
        assert levels.numel() == 2**bits, f"group {g}: {levels.numel()} levels"
        assert levels.min() == -(2 ** (bits - 1)) and levels.max() == 2 ** (bits - 1) - 1
    assert torch.allclose(scale.t().reshape(-1), spread.view(-1) / 2 ** (bits - 1))
    dequantized = (q.float() * scale[..., None]).permute(1, 0, 2).reshape(3, in_features)
    assert torch.equal(dequantized, layer.compressed_weight()[0].detach())  # the forward multiplies these


def test_lkd_lowers_each_blocks_error_and_trains_only_that_block():
    model = TinyDecoder()
    head, emb = model.head.weight.clone(), model.tok_emb.weight.clone()
    report = zeroquant(model, zq_config(4, 8), calibration=calibration(), lkd_steps=8, lkd_lr=2e-3)
    assert [e.name for e in report] == ["blocks.0", "blocks.1"]
    for error in report:
        assert error.after < 0.8 * error.before, error
    assert torch.equal(model.head.weight, head) and torch.equal(model.tok_emb.weight, emb)
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_zeroquant_refuses_what_is_not_post_training_and_names_the_fix():
    with pytest.raises(ValueError, match="set quantize_weight_in_forward: true or start_bits = target_bits"):
        schedule = zq_config(4, 8, shared={"quantize_weight_in_forward": False}, params={"start_bits": 8})
        zeroquant(TinyDecoder(), schedule)
    with pytest.raises(ValueError, match="quantize_group_size=24 does not divide the 32 input features"):
        zeroquant(TinyDecoder(), zq_config(8, 24))
    with pytest.raises(ConfigError, match="quantize_groups .* or quantize_group_size .*, not both"):
        zeroquant(TinyDecoder(), zq_config(8, 8, shared={"quantize_groups": 4}))
    with pytest.raises(ValueError, match="calibration is empty"):
        layer_by_layer_distillation(TinyDecoder(), TinyDecoder(), [])
    with pytest.raises(ValueError, match="blocks='ln_f' names a LayerNorm"):
        layer_by_layer_distillation(TinyDecoder(), TinyDecoder(), calibration(), blocks="ln_f")


@pytest.mark.parametrize("bits, group", [(8, 32), (4, 8)])
def test_init_inference_runs_zeroquant_layers_on_int8_kernels(bits, group):
    pytest.importorskip("torchao")
    from shardwise.inference._int8_kernels import Int8DynamicLinear

    model = TinyDecoder(seed=1)
    zeroquant(model, zq_config(bits, group))
    model.eval()
    prompt = calibration(1)[0][:1]
    with torch.no_grad():
        expected = model(prompt)
    engine = shardwise.init_inference(copy.deepcopy(model), dtype=torch.int8)
    kernels = [m for m in engine.module.modules() if isinstance(m, Int8DynamicLinear)]
    assert len(kernels) == 8 and engine.int8_report["kernel_layers"] == 8
    assert engine.module.head.weight.dtype == torch.float32  # not named by the config: left as it is
    assert all(not any(p.is_floating_point() and p.dim() == 2 for p in k.parameters()) for k in kernels)
    assert kernels[0].qweight.dtype == torch.int8
    logits = engine(prompt)
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()
    tokens, reference = prompt, prompt
    for _ in range(4):  # greedy decoding agrees with the fake-quantized model
        tokens = torch.cat([tokens, engine(tokens)[:, -1:].argmax(-1)], dim=1)
        with torch.no_grad():
            reference = torch.cat([reference, model(reference)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(tokens, reference)


def test_int8_kernels_without_torchao_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.kernel.intmm", None)
    model = TinyDecoder()
    zeroquant(model, zq_config(8, 32))
    with pytest.raises(ImportError, match=r"pip install 'shardwise\[quant\]'"):
        shardwise.init_inference(model, dtype=torch.int8)


def test_lkd_puts_back_a_block_whose_error_rose():
    student, teacher = TinyDecoder(), TinyDecoder()
    init_compression(student, zq_config(4, 8))
    start = copy.deepcopy(student.state_dict())
    report = layer_by_layer_distillation(student, teacher, calibration(1), steps=2, lr=10.0)
    assert all(e.after == e.before for e in report)
    assert all(torch.equal(v, start[k]) for k, v in student.state_dict().items())
