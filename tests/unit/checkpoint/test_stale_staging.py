"""Staging directories left by killed saves are removed at the next save, and nothing else is."""

import os
import time

import torch

from shardwise import checkpoint as ckpt

HOUR_AGO = time.time() - 3600


def _staging(save_dir, tag, *, files=("model.safetensors",), age=HOUR_AGO):
    path = save_dir / f".{tag}.staging"
    path.mkdir()
    for name in files:
        (path / name).write_bytes(b"partial")
        os.utime(path / name, (age, age))
    os.utime(path, (age, age))
    return path


def test_only_old_staging_directories_of_other_tags_are_removed(tmp_path):
    save_dir = tmp_path / "ckpt"
    ckpt.write_checkpoint(save_dir, "global_step1", files={"model.safetensors": {"w": torch.ones(2)}}, manifest={})
    complete = {p: p.read_bytes() for p in (save_dir / "global_step1").iterdir()}
    stale = _staging(save_dir, "global_step3")
    current = _staging(save_dir, "global_step9")  # begin_checkpoint's to clean, not ours
    fresh = _staging(save_dir, "global_step5", age=time.time())  # maybe another job's save
    finished = _staging(save_dir, "global_step7", files=("model.safetensors", "manifest.json"))
    backup, tmp = save_dir / ".global_step1.old-1a2b", save_dir / ".global_step1.tmp-3c4d"
    backup.mkdir()
    tmp.mkdir()
    not_a_dir = save_dir / ".notes.staging"
    not_a_dir.write_text("mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("keep")
    link = save_dir / ".linked.staging"
    link.symlink_to(elsewhere)
    os.utime(link, (HOUR_AGO, HOUR_AGO), follow_symlinks=False)

    removed, kept = ckpt.remove_stale_staging(save_dir, current_tag="global_step9")

    assert removed == [stale] and not stale.exists()
    assert set(kept) == {fresh, finished, not_a_dir, link}
    assert "another job" in kept[fresh] and "finished checkpoint" in kept[finished]
    assert str(save_dir / "global_step7") in kept[finished]
    assert "not a plain directory" in kept[link] and "not a plain directory" in kept[not_a_dir]
    for path in (current, fresh, finished, backup, tmp, not_a_dir, link):
        assert path.exists() or path.is_symlink(), path
    assert (elsewhere / "data").read_text() == "keep"
    assert {p: p.read_bytes() for p in (save_dir / "global_step1").iterdir()} == complete
    assert ckpt.list_tags(save_dir) == ["global_step1"]


def test_min_age_zero_removes_fresh_ones_and_a_missing_dir_has_none(tmp_path):
    fresh = _staging(tmp_path, "global_step5", age=time.time())
    empty = _staging(tmp_path, "global_step6", files=(), age=time.time())
    assert ckpt.remove_stale_staging(tmp_path, current_tag="x", min_age_s=0) == ([fresh, empty], {})
    assert ckpt.remove_stale_staging(tmp_path / "missing", current_tag="x") == ([], {})
