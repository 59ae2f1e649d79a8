"""The compression configs in examples/configs load and apply to a model named like the
demo GPT (``examples/gpt_model.py``)."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.compression import init_compression, zeroquant
from shardwise.compression._layers import CompressedLinear
from shardwise.config import load_config

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)


class DemoNames(nn.Module):
    """The demo GPT's module names and shapes at width 64 (no forward needed here)."""

    def __init__(self, layers, width=64, vocab=256, seq=16):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)


def _load(name):
    path = CONFIGS / name
    assert load_config(str(path), world_size=1).compression_training.enabled
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    "name, layers",
    [
        ("zero1_compression_qat.json", ("qkv", "proj", "fc", "out")),
        ("zero1_compression_pruning.json", ("qkv", "proj", "fc")),
    ],
)
def test_qat_and_pruning_configs_compress_the_demo_layers(name, layers):
    model = init_compression(DemoNames(4), _load(name))
    compressed = {n for n in ("qkv", "proj", "fc", "out") if isinstance(getattr(model.blocks[3], n), CompressedLinear)}
    assert compressed == set(layers)


def test_xtc_config_keeps_half_the_teacher_layers_with_ternary_weights():
    teacher = DemoNames(4)
    student = init_compression(DemoNames(2), _load("zero1_compression_xtc.json"), teacher_model=teacher)
    assert torch.equal(student.blocks[0].fc.weight, teacher.blocks[1].fc.weight)
    assert torch.equal(student.blocks[1].fc.weight, teacher.blocks[3].fc.weight)
    weight = student.blocks[0].fc.compressed_weight()[0].detach()
    assert all(group.unique().numel() <= 3 for group in weight.reshape(-1, 64))


def test_zeroquant_config_quantizes_the_blocks_at_4_bits():
    model = DemoNames(2)
    zeroquant(model, _load("compression_zeroquant.json"))
    assert {m.current_bits() for m in model.modules() if isinstance(m, CompressedLinear)} == {4}
    assert not isinstance(model.head, CompressedLinear)
