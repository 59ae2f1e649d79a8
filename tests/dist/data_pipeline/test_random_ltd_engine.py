"""Random-LTD switched on by the config (``data_efficiency.data_routing.random_ltd``) on 2
ranks at ZeRO stages 2 and 3: ``initialize`` finds the converted layers, every training
forward of a step runs them on the scheduled number of tokens (DeepSpeed's schedule at the
optimizer steps taken so far), evaluation runs every token, and a run resumed from a
checkpoint mid-ramp continues the schedule and the consumed layer tokens exactly."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.runtime.data_pipeline.data_routing import convert_to_random_ltd
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL

SEQ, HIDDEN, MICRO, GAS, STEPS, SAVE_AT = 32, 8, 2, 2, 5, 2
RANDOM_LTD = {
    "enabled": True,
    "total_layer_num": 4,
    "random_ltd_layer_num": 2,
    "random_ltd_layer_id": [1, 2],
    "model_mask_name": None,
    "model_type": "decoder",
    "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {
        "min_value": 8,
        "max_value": SEQ,
        "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 3, "seq_per_step": 8},
    },
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden):
        return hidden + torch.tanh(self.proj(hidden))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _engine(stage, tmp):
    model = convert_to_random_ltd(Model(), Block)
    seen = []  # tokens the two dropping blocks ran on, per forward
    for block in model.blocks[1:3]:
        block.random_ltd_layer.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    zero = {"stage": stage, **(STAGE3_PARTITION_ALL if stage == 3 else {})}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": RANDOM_LTD}},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    return engine, seen


def _train(engine, seen, steps, out):
    generator = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(steps):
        kept = []
        for _ in range(GAS):
            seen.clear()
            engine.backward(engine(torch.randn(MICRO, SEQ, HIDDEN, generator=generator)))
            engine.step()
            kept.append(list(seen))
        out.append(kept)


def _job(rank, world_size, stage, tmp):
    engine, seen = _engine(stage, tmp)
    assert len(engine.training_features.find("random_ltd").layers) == 2
    whole = []
    _train(engine, seen, STEPS, whole)
    engine.eval()
    seen.clear()
    engine(torch.randn(MICRO, SEQ, HIDDEN))
    evaluated = list(seen)
    consumed = engine.training_features.find("random_ltd").consumed_layer_tokens

    first, seen_first = _engine(stage, tmp)
    part = []
    _train(first, seen_first, SAVE_AT, part)
    first.save_checkpoint(tmp, tag="mid")
    resumed, seen_resumed = _engine(stage, tmp)
    resumed.load_checkpoint(tmp, tag="mid")
    _train(resumed, seen_resumed, STEPS - SAVE_AT, part)
    return whole, evaluated, part, consumed, resumed.training_features.find("random_ltd").consumed_layer_tokens


@pytest.mark.parametrize("stage", [2, 3])
def test_config_drives_the_converted_layers_and_resumes(tmp_path, stage):
    results = run_distributed(_job, world_size=2, tmp_path=tmp_path, stage=stage, tmp=str(tmp_path / "ckpt"))
    # DeepSpeed's fixed_linear ramp: 8 tokens, +8 every 3 / (32 - 8) * 8 = 1 step, up to 32
    schedule = [8, 16, 24, 32, 32]
    for whole, evaluated, part, consumed, consumed_resumed in results:
        assert whole == [[[k, k]] * GAS for k in schedule]
        assert evaluated == [SEQ, SEQ]
        assert part == whole, "the resumed run continues the schedule where the checkpoint left it"
        assert consumed == consumed_resumed > 0
