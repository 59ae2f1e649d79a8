"""snip_momentum on 2 data-parallel ranks at ZeRO stages 0 and 2, each on half of every
global batch, keeps the masks and reaches the weights of one process on the whole batch
(torch's SGD and AdamW), as DeepSpeed's scores read the all-reduced gradient."""

import torch

import shardwise
from shardwise.compression.compress import init_compression
from shardwise.compression.scheduler import CompressionScheduler
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import engine_train, max_param_diff

STEPS, MICRO = 4, 2
SHARED = {
    "enabled": True,
    "method": "snip_momentum",
    "dense_ratio": 0.5,
    "schedule_offset": 1,
    "schedule_offset_end": 3,
    "excluded_modules": ["head"],
}
COMPRESSION = {"compression_training": {"sparse_pruning": {"shared_parameters": SHARED}}}
OPTIMIZERS = {"SGD": (torch.optim.SGD, {"lr": 0.1}), "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01})}


def _reference(batches, optimizer):
    """One process on the whole batches, in the engine's order: scores and masks, then the step."""
    model = init_compression(TinyMLP(seed=1), COMPRESSION)
    scheduler = CompressionScheduler(model)
    kind, params = OPTIMIZERS[optimizer]
    torch_optimizer = kind(model.parameters(), **params)
    for tokens, targets in batches:
        model(tokens, targets).backward()
        scheduler.step()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    return model


def _masks(model):
    return [model.fc1.sparse_pruning_mask.clone(), model.fc2.sparse_pruning_mask.clone()]


def _check(rank, world_size):
    batches = token_batches(num_steps=STEPS, batch=MICRO * world_size, seed=4)
    report = {}
    for optimizer, (_, params) in OPTIMIZERS.items():
        reference = _reference(batches, optimizer)
        for stage in (0, 2):
            config = {
                **COMPRESSION,
                "train_micro_batch_size_per_gpu": MICRO,
                "optimizer": {"type": optimizer, "params": params},
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage},
            }
            model = init_compression(TinyMLP(seed=1), config)
            engine, _, _, _ = shardwise.initialize(model=model, config=config)
            engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
            same_masks = all(torch.equal(a, b) for a, b in zip(_masks(model), _masks(reference), strict=True))
            zeros = sum(int((m == 0).sum()) for m in _masks(model))
            report[(optimizer, stage)] = (same_masks, zeros, max_param_diff(reference, engine.module))
    return report


def test_two_ranks_keep_the_masks_and_weights_of_one_process(tmp_path):
    for report in run_distributed(_check, world_size=2, tmp_path=tmp_path):
        for case, (same_masks, zeros, worst) in report.items():
            assert same_masks, case
            assert zeros == (32 * 16 + 16 * 32) // 2, case
            assert worst < 1e-5, (case, worst)
