"""``save_checkpoint`` given a different directory on each rank (HelloDeepSpeed names it
by the second, so ranks that start a second apart differ) is refused on every rank with
an error naming each rank's directory and the fix, before anything is written."""

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1000,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}


def _save_to_own_directory(rank, world_size, root):
    engine, *_ = shardwise.initialize(model=TinyMLP(seed=1), config=CONFIG)
    try:
        engine.save_checkpoint(f"{root}/run-{rank}")
    except ValueError as exc:
        return str(exc)
    return None


def test_a_different_directory_on_each_rank_is_a_clear_error(tmp_path):
    root = tmp_path / "saves"
    messages = run_distributed(_save_to_own_directory, world_size=2, tmp_path=tmp_path, root=str(root))
    for message in messages:
        assert message is not None
        assert "different directory on each rank" in message, message
        assert f"rank 0: '{root}/run-0'" in message and f"rank 1: '{root}/run-1'" in message, message
        assert "pass the same save_dir on every rank" in message, message
    assert not root.exists()  # refused before any rank wrote
