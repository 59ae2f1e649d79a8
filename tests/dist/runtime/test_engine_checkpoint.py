"""Save at step k, load into a fresh engine, continue: identical to never stopping."""

import pytest
import torch

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches

MICRO = 2


def _config(dtype):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def _train(engine, batches, rank, world_size):
    for tokens, targets in batches:
        for micro in range(engine.gradient_accumulation_steps()):
            start = (micro * world_size + rank) * MICRO
            engine.backward(engine(tokens[start : start + MICRO], targets[start : start + MICRO]))
            engine.step()


def _resume(rank, world_size, save_dir, dtype):
    batches = token_batches(num_steps=6, batch=MICRO * 2 * world_size, seed=3)
    config = _config(dtype)
    straight, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=config)
    _train(straight, batches[:3], rank, world_size)
    straight.save_checkpoint(save_dir, client_state={"epoch": 7, "note": "hello", "ids": torch.arange(3)})
    _train(straight, batches[3:], rank, world_size)

    resumed, _, _, _ = shardwise.initialize(model=TinyMLP(seed=99), config=config)
    path, client = resumed.load_checkpoint(save_dir)
    assert path.endswith("global_step3"), path
    assert client["epoch"] == 7 and client["note"] == "hello"
    assert torch.equal(client["ids"], torch.arange(3))
    assert resumed.global_steps == 3
    _train(resumed, batches[3:], rank, world_size)
    same = all(torch.equal(a, b) for a, b in zip(straight.module.parameters(), resumed.module.parameters()))
    return same, resumed.get_lr() == straight.get_lr(), resumed.global_samples == straight.global_samples


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_resume_is_bit_identical(tmp_path, dtype):
    results = run_distributed(_resume, world_size=2, tmp_path=tmp_path, save_dir=str(tmp_path / "ckpt"), dtype=dtype)
    assert all(all(r) for r in results), results


def _save_only(rank, world_size, save_dir):
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=_config("fp32"))
    engine.save_checkpoint(save_dir, tag="one")
    return True


def _load_only(rank, world_size, save_dir, tag):
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=_config("fp32"))
    try:
        engine.load_checkpoint(save_dir, tag=tag)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_damaged_checkpoint_is_a_clear_error(tmp_path):
    save_dir = tmp_path / "ckpt"
    run_distributed(_save_only, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir))
    target = save_dir / "one" / "optimizer.safetensors"
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    messages = run_distributed(_load_only, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir), tag="one")
    assert all(m and "optimizer.safetensors" in m and "truncated" in m for m in messages), messages
    target.unlink()
    messages = run_distributed(_load_only, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir), tag="one")
    assert all(m and "optimizer.safetensors" in m and "missing" in m for m in messages), messages


def test_missing_latest_starts_fresh(tmp_path):
    # DeepSpeed's contract: load_checkpoint on a directory without checkpoints returns (None, None).
    results = run_distributed(_resume_missing, world_size=2, tmp_path=tmp_path, save_dir=str(tmp_path / "empty"))
    assert results == [(None, None), (None, None)]


def _resume_missing(rank, world_size, save_dir):
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=_config("fp32"))
    return engine.load_checkpoint(save_dir)


def _save_stage2(rank, world_size, save_dir):
    config = {**_config("bf16"), "zero_optimization": {"stage": 2, "reduce_bucket_size": 300}}
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=config)
    _train(engine, token_batches(num_steps=2, batch=MICRO * 2 * world_size, seed=3), rank, world_size)
    engine.save_checkpoint(save_dir, tag="one")
    return [p.detach().clone() for p in engine.module.parameters()]


def _load_stage2(rank, world_size, save_dir):
    config = {**_config("bf16"), "zero_optimization": {"stage": 2, "reduce_bucket_size": 300}}
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=99), config=config)
    try:
        engine.load_checkpoint(save_dir, tag="one")
    except CheckpointError as exc:
        return str(exc)
    return [p.detach().clone() for p in engine.module.parameters()]


def test_sharded_checkpoint_parts_are_checked_and_the_single_file_layout_still_loads(tmp_path):
    import json

    import safetensors.torch

    from shardwise.checkpoint._format import sha256_file

    save_dir = tmp_path / "ckpt"
    saved = run_distributed(_save_stage2, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir))[0]
    folder = save_dir / "one"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["skeletons"]["optimizer_files"][1:] == ["optimizer-00001.safetensors"]
    assert manifest["skeletons"]["module_files"][1:] == ["model-00001.safetensors"]
    # the layout of earlier versions: one file each, no part lists in the manifest
    for stem, key in (("optimizer", "optimizer_files"), ("model", "module_files")):
        merged = {}
        for name in manifest["skeletons"].pop(key):
            merged.update(safetensors.torch.load_file(str(folder / name)))
            (folder / name).unlink()
            del manifest["files"][name]
        safetensors.torch.save_file(merged, str(folder / f"{stem}.safetensors"))
        manifest["files"][f"{stem}.safetensors"] = {
            "bytes": (folder / f"{stem}.safetensors").stat().st_size,
            "sha256": sha256_file(folder / f"{stem}.safetensors"),
        }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for loaded in run_distributed(_load_stage2, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir)):
        assert not isinstance(loaded, str), loaded
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded))
    # a damaged part is named
    run_distributed(_save_stage2, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir))
    part = folder / "optimizer-00001.safetensors"
    part.write_bytes(part.read_bytes()[:100])
    for message in run_distributed(_load_stage2, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir)):
        assert isinstance(message, str) and "optimizer-00001.safetensors" in message and "truncated" in message
