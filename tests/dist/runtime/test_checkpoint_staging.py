"""A save removes the staging directories that killed saves left, and touches nothing else."""

import logging
import os
import time

import torch

import shardwise
from shardwise.checkpoint._format import sha256_file
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches

CONFIG = {
    "gradient_clipping": 0.0,
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _leftovers(save_dir):
    """What a job killed mid-save an hour ago left, and a save another job is writing now."""
    stale = save_dir / ".global_step3.staging"
    stale.mkdir()
    (stale / "model-00001.safetensors").write_bytes(b"half written")
    fresh = save_dir / ".global_step5.staging"
    fresh.mkdir()
    hour_ago = time.time() - 3600
    for path in (stale / "model-00001.safetensors", stale):
        os.utime(path, (hour_ago, hour_ago))


def _save_after_a_killed_save(rank, world_size, save_dir):
    from pathlib import Path

    save_dir = Path(save_dir)
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=CONFIG)
    records = _Records()
    logging.getLogger("shardwise").addHandler(records)

    def train_one_step(batch):
        tokens, targets = batch
        mine = slice(2 * rank, 2 * rank + 2)
        engine.backward(engine(tokens[mine], targets[mine]))
        engine.step()

    batches = token_batches(num_steps=2, batch=2 * world_size, seed=3)
    train_one_step(batches[0])
    engine.save_checkpoint(save_dir, tag="complete")
    complete = {p.name: sha256_file(p) for p in (save_dir / "complete").iterdir()}
    if rank == 0:
        _leftovers(save_dir)
    torch.distributed.barrier()
    train_one_step(batches[1])
    engine.save_checkpoint(save_dir)
    hidden = sorted(p.name for p in save_dir.iterdir() if p.name.startswith("."))
    untouched = complete == {p.name: sha256_file(p) for p in (save_dir / "complete").iterdir()}

    resumed, _, _, _ = shardwise.initialize(model=TinyMLP(seed=99), config=CONFIG)
    path, _ = resumed.load_checkpoint(save_dir)
    same = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), resumed.module.parameters()))
    return {
        "hidden": hidden,
        "complete untouched": untouched,
        "loaded": Path(path).name,
        "same params": same,
        "log": [m for m in records.messages if "staging" in m],
    }


def test_stale_staging_is_removed_at_the_next_save(tmp_path):
    save_dir = tmp_path / "ckpt"
    results = run_distributed(_save_after_a_killed_save, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir))
    for rank, result in enumerate(results):
        assert result["hidden"] == [".global_step5.staging"], (rank, result)
        assert result["complete untouched"] and result["same params"], (rank, result)
        assert result["loaded"] == "global_step2", (rank, result)
    removed, kept = results[0]["log"]
    assert f"removed {save_dir / '.global_step3.staging'}" in removed, removed
    assert str(save_dir / ".global_step5.staging") in kept and "another job" in kept, kept
    assert results[1]["log"] == []  # rank 0 cleans and reports
