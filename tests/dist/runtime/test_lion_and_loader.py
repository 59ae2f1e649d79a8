"""The Lion optimizer from the config under ZeRO-2 matches single-process Lion, and
``dataloader_drop_last`` reaches the loader ``initialize()`` returns."""

import copy

import torch

import shardwise
from shardwise.optim import Lion
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches

MICRO = 2


def _lion(rank, world_size):
    model = TinyMLP(seed=3)
    reference = copy.deepcopy(model)
    optimizer = Lion(reference.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": "Lion", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 300},
        },
    )
    start = copy.deepcopy(reference)
    for tokens, targets in token_batches(num_steps=3, batch=MICRO * world_size, seed=1):
        reference(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(tokens[part], targets[part]))
        engine.step()
    diff = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), engine.module.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), start.parameters()))
    loaders = {}
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    for drop in (False, True):
        _, _, loader, _ = shardwise.initialize(
            model=torch.nn.Linear(1, 1),
            training_data=data,
            config={
                "gradient_clipping": 0.0,
                "train_micro_batch_size_per_gpu": MICRO,
                "dataloader_drop_last": drop,
                "steps_per_print": 1000,
            },
        )
        loaders[drop] = [len(batch[0]) for batch in loader]
    return diff, moved, engine.optimizer_name(), loaders


def test_lion_under_zero2_and_drop_last(tmp_path):
    for diff, moved, name, loaders in run_distributed(_lion, world_size=2, tmp_path=tmp_path):
        assert moved > 1e-2 and diff < 1e-6, (diff, moved)  # Lion moves each weight by lr per step
        assert name == "lion"
        assert loaders == {False: [2, 2, 1], True: [2, 2]}
