"""snip_momentum on 2 data-parallel ranks (ZeRO-2): every rank keeps the same blocks, and the
schedule reaches dense_ratio."""

import shardwise
from shardwise.compression.compress import init_compression
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import engine_train

MICRO = 2
SHARED = {
    "enabled": True,
    "method": "snip_momentum",
    "dense_ratio": 0.5,
    "schedule_offset": 1,
    "schedule_offset_end": 2,
    "excluded_modules": ["head"],
}


def _masks(rank, world_size):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
        "compression_training": {"sparse_pruning": {"shared_parameters": SHARED}},
    }
    model = init_compression(TinyMLP(seed=1), config)
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    batches = token_batches(num_steps=3, batch=MICRO * world_size, seed=4)
    engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
    return [model.fc1.sparse_pruning_mask.tolist(), model.fc2.sparse_pruning_mask.tolist()]


def test_the_ranks_keep_the_same_blocks(tmp_path):
    first, second = run_distributed(_masks, world_size=2, tmp_path=tmp_path)
    assert first == second
    zeros = sum(row.count(0.0) for mask in first for row in mask)
    assert zeros == (32 * 16 + 16 * 32) // 2
