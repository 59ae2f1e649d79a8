"""The demo GPT takes the keywords the engine passes under ``curriculum_learning`` and
``progressive_layer_drop`` (examples/configs/zero1_curriculum_pld.json)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402


def test_curriculum_seqlen_cuts_the_batch_and_pld_skips_blocks_only_in_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, width=16, num_layers=3, num_heads=2, seq_len=8))
    idx = torch.randint(0, 32, (2, 8))
    assert torch.equal(model(idx, idx, curriculum_seqlen=4), model(idx[:, :4], idx[:, :4]))
    full = model(idx, idx)
    dropped = [model(idx, idx, progressive_layer_drop=True, pld_theta=0.0) for _ in range(6)]
    assert any(not torch.equal(loss, full) for loss in dropped)  # theta 0: the last block always skipped
    model.eval()
    assert torch.equal(model(idx, idx, progressive_layer_drop=True, pld_theta=0.0), full)
