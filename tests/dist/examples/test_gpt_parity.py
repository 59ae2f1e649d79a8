"""The GPT example (tied head, attention, LayerNorms) under ZeRO-3, built partitioned by
zero.Init, on 2 and 4 ranks matches single-process PyTorch training."""

import sys
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL, max_param_diff

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, width=32, num_layers=2, num_heads=2, seq_len=16)
MICRO, GAS, STEPS, LR = 2, 2, 3, 3e-3
CLIP = 0.5
EPS = 1e-6  # Adam's 1e-8 turns rounding noise in near-zero gradients into lr-sized steps


def _train(rank, world_size, knobs):
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    batch = MICRO * GAS * world_size
    data = [torch.randint(0, 64, (batch, 17), generator=generator) for _ in range(STEPS)]
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1, eps=EPS)
    for tokens in data:
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "eps": EPS}},
        "zero_optimization": {"stage": 3, **knobs},
    }
    torch.manual_seed(0)
    with shardwise.zero.Init(config_dict_or_path=config):
        model = GPT(CONFIG)
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    norms = []
    for tokens in data:
        for micro in range(GAS):
            start = (micro * world_size + rank) * MICRO
            mine = tokens[start : start + MICRO]
            engine.backward(engine(mine[:, :-1], mine[:, 1:]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return max_param_diff(reference, engine.module), max(norms)


@pytest.mark.parametrize(
    "world_size,knobs",
    [(2, STAGE3_PARTITION_ALL), (4, STAGE3_PARTITION_ALL), (2, {})],
    ids=["2 ranks partition all", "4 ranks partition all", "2 ranks DeepSpeed defaults"],
)
def test_gpt_example_stage3_matches_single_process(tmp_path, world_size, knobs):
    for diff, largest_norm in run_distributed(_train, world_size=world_size, tmp_path=tmp_path, knobs=knobs):
        assert largest_norm > CLIP  # clipping was exercised
        assert diff < 2e-5
