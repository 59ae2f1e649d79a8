"""Quantization-aware training with pruning on 2 ranks at ZeRO stages 0, 1 and 2 equals one
process running the same compressed model on the full global batches with torch's SGD,
moving the schedule after every step."""

import torch

import shardwise
from shardwise.compression.compress import init_compression
from shardwise.compression.scheduler import CompressionScheduler
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import engine_train, max_param_diff

STEPS, MICRO, LR = 4, 2, 0.1
COMPRESSION = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_groups": 2},
        "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 6}, "modules": ["fc"]}},
    },
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 1},
        "different_groups": {"a": {"params": {"bits": 8}, "modules": ["fc2"]}},
    },
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 2},
        "different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}},
    },
}


def _reference(batches):
    model = init_compression(TinyMLP(seed=1), {"compression_training": COMPRESSION})
    scheduler = CompressionScheduler(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (tokens, targets) in enumerate(batches):
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.set_step(step + 1)
    return model


def _check(rank, world_size):
    batches = token_batches(num_steps=STEPS, batch=MICRO * world_size, seed=4)
    reference = _reference(batches)
    report = {}
    for stage in (0, 1, 2):
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "compression_training": COMPRESSION,
        }
        model = init_compression(TinyMLP(seed=1), config)
        engine, _, _, _ = shardwise.initialize(model=model, config=config)
        engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
        report[stage] = (max_param_diff(reference, engine.module), model.fc1.current_bits(), model.fc1.step)
    return report


def test_qat_with_pruning_on_two_ranks_matches_one_process(tmp_path):
    for report in run_distributed(_check, world_size=2, tmp_path=tmp_path):
        for stage, (worst, bits, step) in report.items():
            assert (bits, step) == (6, STEPS), stage
            assert worst < 1e-5, (stage, worst)
