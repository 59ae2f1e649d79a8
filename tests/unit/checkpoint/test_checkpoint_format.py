"""The checkpoint format on one process: round-trips, atomic writes and clear errors."""

import json
import random

import numpy as np
import pytest
import safetensors.torch
import torch

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint._read import _map_tensors


def _json_round_trip(skeleton):
    return json.loads(json.dumps(skeleton, allow_nan=False))


def _assert_same(a, b, path="<root>"):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for key in a:
            _assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


def _model_and_adamw(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-2},
            {"params": model[2].parameters(), "lr": 5e-3, "weight_decay": 0.0},
        ],
        betas=(0.8, 0.9),
    )
    return model, optimizer


def _adamw_step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(5, 4, generator=generator)).square().sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_adamw_state_round_trips_and_resumes_identically():
    model, optimizer = _model_and_adamw()
    for seed in range(2):
        _adamw_step(model, optimizer, seed)
    state = optimizer.state_dict()
    tensors, skeleton = ckpt.flatten_state(state, prefix="optimizer")
    assert "optimizer.state.0.exp_avg" in tensors and "optimizer.state.0.step" in tensors
    restored = ckpt.unflatten_state(tensors, _json_round_trip(skeleton))
    _assert_same(state, restored)
    assert isinstance(restored["param_groups"][0]["betas"], tuple)
    assert all(isinstance(k, int) for k in restored["state"])

    fresh_model, fresh_optimizer = _model_and_adamw(seed=5)
    fresh_model.load_state_dict(model.state_dict())
    fresh_optimizer.load_state_dict(restored)
    _adamw_step(model, optimizer, seed=7)
    _adamw_step(fresh_model, fresh_optimizer, seed=7)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


def test_plain_states_round_trip():
    scheduler = torch.optim.lr_scheduler.StepLR(_model_and_adamw()[1], step_size=3)
    samples = {
        "scheduler": scheduler.state_dict(),
        "scheduler_like": {
            "last_epoch": 4,
            "base_lrs": [0.1, 0.2],
            "_step_count": 5,
            "verbose": False,
            "name": None,
            "scale": float("inf"),
            "nan": float("-inf"),
        },
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "meta": {
            "dtype": torch.bfloat16,
            "size": torch.Size([2, 3]),
            "device": torch.device("cpu"),
            "marker_key": {"__tensor__": "not a reference"},
            3: "int key",
            True: "bool key",
        },
        "scalars": [torch.tensor(3.5), torch.zeros(0), torch.arange(6).view(2, 3).t()],
    }
    tensors, skeleton = ckpt.flatten_state(samples)
    restored = ckpt.unflatten_state(tensors, _json_round_trip(skeleton))
    _assert_same(samples, restored)
    assert restored["python_rng"] == random.getstate()
    assert restored["torch_rng"].dtype == torch.uint8
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())


def test_flattened_tensors_are_independent_copies():
    weight = torch.ones(4, requires_grad=True)
    shared = {"a": weight, "b": weight[:2], "c": weight}
    tensors, _ = ckpt.flatten_state(shared)
    assert set(tensors) == {"a", "b", "c"}
    assert all(not t.requires_grad for t in tensors.values())
    with torch.no_grad():
        weight.mul_(2)
    assert torch.equal(tensors["a"], torch.ones(4))
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 3


def test_colliding_paths_get_distinct_keys():
    tensors, skeleton = ckpt.flatten_state({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    assert set(tensors) == {"a.b", "a.b#2"}
    restored = ckpt.unflatten_state(tensors, skeleton)
    assert torch.equal(restored["a.b"], torch.ones(1)) and torch.equal(restored["a"]["b"], torch.zeros(1))


@pytest.mark.parametrize(
    "value, path, type_name",
    [
        ({"opt": {"state": [1, object()]}}, "opt.state.1", "object"),
        ({"fn": lambda x: x}, "fn", "function"),
        ({"arr": np.zeros(2)}, "arr", "ndarray"),
        ({(1, 2): 3}, "(1, 2)", "tuple"),
    ],
)
def test_unsupported_value_names_its_path(value, path, type_name):
    with pytest.raises(TypeError) as info:
        ckpt.flatten_state(value)
    message = str(info.value)
    assert repr(path) in message and type_name in message and "only store tensors" in message


def test_reference_cycle_is_a_type_error():
    loop = []
    loop.append(loop)
    with pytest.raises(TypeError, match="cycle"):
        ckpt.flatten_state({"loop": loop})


def test_missing_tensor_names_the_key():
    tensors, skeleton = ckpt.flatten_state({"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="'w'"):
        ckpt.unflatten_state({}, skeleton)


def _save(save_dir, tag, value, *, save_latest=True):
    model_tensors, model_skeleton = ckpt.flatten_state({"w": torch.full((3,), float(value))})
    extra_tensors, extra_skeleton = ckpt.flatten_state({"step": torch.tensor(value)})
    return ckpt.write_checkpoint(
        save_dir,
        tag,
        files={"model.safetensors": model_tensors, "extra.safetensors": extra_tensors},
        manifest={"global_steps": value, "skeletons": {"model": model_skeleton, "extra": extra_skeleton}},
        save_latest=save_latest,
    )


def _load_value(save_dir, tag=None):
    path = save_dir / ckpt.resolve_tag(save_dir, tag)
    manifest = ckpt.read_manifest(path)
    model = ckpt.unflatten_state(
        ckpt.read_tensors(path, "model.safetensors", manifest=manifest), manifest["skeletons"]["model"]
    )
    return manifest["global_steps"], model["w"]


def _hidden(save_dir):
    return sorted(p.name for p in save_dir.iterdir() if p.name.startswith("."))


def test_write_then_read_round_trip(tmp_path):
    save_dir = tmp_path / "ckpt"
    path = _save(save_dir, "global_step5", 5)
    assert path == save_dir / "global_step5"
    assert (save_dir / "latest").read_text() == "global_step5"
    assert ckpt.resolve_tag(save_dir) == "global_step5"
    manifest = ckpt.read_manifest(path)
    assert manifest["format"] == "shardwise" and manifest["format_version"] == ckpt.FORMAT_VERSION
    assert set(manifest["files"]) == {"model.safetensors", "extra.safetensors"}
    assert manifest["files"]["model.safetensors"]["bytes"] == (path / "model.safetensors").stat().st_size
    steps, weight = _load_value(save_dir)
    assert steps == 5 and torch.equal(weight, torch.full((3,), 5.0))
    assert sorted(p.name for p in path.iterdir()) == ["extra.safetensors", "manifest.json", "model.safetensors"]
    assert _hidden(save_dir) == []


def test_save_latest_false_keeps_latest_and_tags_sort_naturally(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save(save_dir, "global_step9", 9)
    _save(save_dir, "global_step10", 10, save_latest=False)
    assert ckpt.resolve_tag(save_dir) == "global_step9"
    assert ckpt.list_tags(save_dir) == ["global_step9", "global_step10"]
    steps, weight = _load_value(save_dir, "global_step10")
    assert steps == 10 and torch.equal(weight, torch.full((3,), 10.0))


def test_overwrite_same_tag_leaves_no_leftovers(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save(save_dir, "same", 1)
    _save(save_dir, "same", 2)
    steps, weight = _load_value(save_dir)
    assert steps == 2 and torch.equal(weight, torch.full((3,), 2.0))
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "same"]


def test_failure_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    _save(save_dir, "same", 1)
    real_save_file, calls = safetensors.torch.save_file, []

    def failing_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk full")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        _save(save_dir, "same", 2)
    with pytest.raises(OSError, match="disk full"):
        _save(save_dir, "other", 3)
    monkeypatch.undo()
    steps, weight = _load_value(save_dir)
    assert steps == 1 and torch.equal(weight, torch.full((3,), 1.0))
    assert (save_dir / "latest").read_text() == "same"
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "same"]


def test_multi_writer_pieces(tmp_path):
    save_dir = tmp_path / "ckpt"
    staging = ckpt.begin_checkpoint(save_dir, "t", clean=True)
    (staging / "stale.safetensors").write_bytes(b"left by a crash")
    assert ckpt.begin_checkpoint(save_dir, "t", clean=False) == staging
    staging = ckpt.begin_checkpoint(save_dir, "t", clean=True)
    assert list(staging.iterdir()) == []
    records = {}
    for rank in range(2):
        tensors, _ = ckpt.flatten_state({"rank": torch.tensor(rank)})
        records.update(ckpt.write_files(staging, {f"rng_rank{rank}.safetensors": tensors}))
    with pytest.raises(CheckpointError, match="no record"):
        ckpt.finalize_checkpoint(
            save_dir,
            "t",
            staging,
            manifest={},
            save_latest=True,
            file_records={"rng_rank0.safetensors": records["rng_rank0.safetensors"]},
        )
    assert not staging.exists() and not (save_dir / "latest").exists()

    staging = ckpt.begin_checkpoint(save_dir, "t", clean=True)
    for rank in range(2):
        tensors, _ = ckpt.flatten_state({"rank": torch.tensor(rank)})
        ckpt.write_files(staging, {f"rng_rank{rank}.safetensors": tensors})
    with pytest.raises(CheckpointError, match="already exists"):
        ckpt.write_files(staging, {"rng_rank1.safetensors": {}})
    path = ckpt.finalize_checkpoint(save_dir, "t", staging, manifest={"n": 2}, file_records=records, save_latest=True)
    assert ckpt.read_tensors(path, "rng_rank1.safetensors")["rank"].item() == 1
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "t"]


def test_write_files_needs_staging_dir(tmp_path):
    staging = ckpt.begin_checkpoint(tmp_path, "t", clean=False)
    assert not staging.exists()
    with pytest.raises(CheckpointError, match="begin_checkpoint"):
        ckpt.write_files(staging, {"a.safetensors": {}})


def test_finalize_rejects_reserved_keys_and_non_json(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        ckpt.write_checkpoint(tmp_path, "t", files={}, manifest={"files": 1})
    with pytest.raises(TypeError, match="flatten_state"):
        ckpt.write_checkpoint(tmp_path, "t", files={}, manifest={"x": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("tag", ["", "a/b", "..", "x..y", ".hidden", "latest", "tab\there"])
def test_invalid_tags_are_rejected(tmp_path, tag):
    with pytest.raises(ValueError, match="invalid checkpoint tag"):
        ckpt.write_checkpoint(tmp_path, tag, files={}, manifest={})


def test_invalid_file_name_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="invalid checkpoint file name"):
        ckpt.write_checkpoint(tmp_path, "t", files={"../x.safetensors": {}}, manifest={})
    assert list(tmp_path.iterdir()) == []


def test_truncated_file(tmp_path):
    path = _save(tmp_path, "one", 1) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError) as info:
        _load_value(tmp_path)
    assert str(path) in str(info.value) and "truncated" in str(info.value)
    assert f"expected {len(data)} bytes, found {len(data) - 10}" in str(info.value)


def test_corrupted_byte_same_size(tmp_path):
    path = _save(tmp_path, "one", 1) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted") as info:
        _load_value(tmp_path)
    assert str(path) in str(info.value)
    ckpt.read_tensors(path.parent, "model.safetensors", verify=False)


def test_unparsable_safetensors_with_matching_record(tmp_path):
    path = _save(tmp_path, "one", 1) / "model.safetensors"
    path.write_bytes(b"\xff" * path.stat().st_size)
    for mmap in (False, True):
        with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
            ckpt.read_tensors(path.parent, "model.safetensors", verify=False, mmap=mmap)


def test_mapped_read_matches_a_full_read_and_never_writes_the_file(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "i64": torch.arange(3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 2),
        "f16": torch.randn(2, 2, dtype=torch.float16),
    }
    path = ckpt.write_checkpoint(
        tmp_path, "t", files={"x.safetensors": tensors}, manifest={"skeletons": {}}, save_latest=False
    )
    before = (path / "x.safetensors").read_bytes()
    full = ckpt.read_tensors(path, "x.safetensors")
    mapped = ckpt.read_tensors(path, "x.safetensors", mmap=True)
    assert set(mapped) == set(tensors)
    for key, tensor in tensors.items():
        assert mapped[key].dtype == tensor.dtype and mapped[key].shape == tensor.shape, key
        assert torch.equal(mapped[key], tensor) and torch.equal(full[key], tensor), key
    mapped["f32"].mul_(0)  # a private copy-on-write mapping: the file keeps its bytes
    assert (path / "x.safetensors").read_bytes() == before
    assert torch.equal(ckpt.read_tensors(path, "x.safetensors", mmap=True)["f32"], tensors["f32"])


def test_mapped_read_refuses_offsets_outside_the_file(tmp_path):
    path = _save(tmp_path, "one", 1) / "model.safetensors"
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] += 4096
    text = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(text) == header_len
    path.write_bytes(data[:8] + text + data[8 + header_len :])
    with pytest.raises(CheckpointError, match="do not hold"):
        ckpt.read_tensors(path.parent, "model.safetensors", verify=False, mmap=True)


def test_missing_file(tmp_path):
    path = _save(tmp_path, "one", 1) / "model.safetensors"
    path.unlink()
    with pytest.raises(CheckpointError, match="is missing") as info:
        _load_value(tmp_path)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="lists no file 'other.safetensors'"):
        ckpt.read_tensors(path.parent, "other.safetensors")


def test_missing_and_damaged_manifest(tmp_path):
    ckpt_dir = _save(tmp_path, "one", 1)
    manifest = ckpt_dir / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="cannot be parsed"):
        ckpt.read_manifest(ckpt_dir)
    manifest.write_text(json.dumps({**json.loads(text), "format_version": 99}))
    with pytest.raises(CheckpointError, match="newer shardwise"):
        ckpt.read_manifest(ckpt_dir)
    manifest.write_text(json.dumps({**json.loads(text), "format": "other"}))
    with pytest.raises(CheckpointError, match="not written by shardwise"):
        ckpt.read_manifest(ckpt_dir)
    manifest.unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing") as info:
        ckpt.read_manifest(ckpt_dir)
    assert str(manifest) in str(info.value)


def test_missing_latest_lists_tags(tmp_path):
    _save(tmp_path, "global_step2", 2)
    _save(tmp_path, "global_step4", 4)
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError) as info:
        ckpt.resolve_tag(tmp_path)
    message = str(info.value)
    assert "latest" in message and "'global_step2', 'global_step4'" in message and "tag=" in message


def test_missing_directories(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.resolve_tag(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoints"):
        ckpt.resolve_tag(tmp_path)
    _save(tmp_path, "one", 1)
    (tmp_path / "latest").write_text("gone\n")
    with pytest.raises(CheckpointError, match="gone.*does not exist.*'one'"):
        ckpt.resolve_tag(tmp_path)
    with pytest.raises(CheckpointError, match="passed as tag="):
        ckpt.resolve_tag(tmp_path, "two")


def test_interrupted_overwrite_is_pointed_out(tmp_path):
    path = _save(tmp_path, "one", 1)
    path.rename(tmp_path / ".one.old-1234")
    with pytest.raises(CheckpointError, match=r"previous complete checkpoint at .*\.one\.old-1234"):
        ckpt.resolve_tag(tmp_path)


def test_deepspeed_directory(tmp_path):
    ds_dir = tmp_path / "global_step10"
    ds_dir.mkdir()
    (ds_dir / "mp_rank_00_model_states.pt").write_bytes(b"pickle")
    (tmp_path / "latest").write_text("global_step10")
    assert ckpt.resolve_tag(tmp_path) == "global_step10"
    with pytest.raises(CheckpointError, match="looks like a DeepSpeed checkpoint") as info:
        ckpt.read_manifest(ds_dir)
    assert "mp_rank_00_model_states.pt" in str(info.value) and "not supported yet" in str(info.value)


def _draws():
    return (random.gauss(0, 1), random.random(), float(np.random.randn()), float(np.random.rand()), torch.rand(3))


def test_rng_capture_restore(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.randn()
    tensors, skeleton = ckpt.flatten_state(ckpt.capture_rng_state())
    assert len(json.dumps(skeleton)) < 1000, "large RNG parts belong in tensors, not the manifest"
    expected = _draws()
    ckpt.write_checkpoint(tmp_path, "rng", files={"rng_rank0.safetensors": tensors}, manifest={"rng": skeleton})
    _draws()
    manifest = ckpt.read_manifest(tmp_path / "rng")
    state = ckpt.unflatten_state(ckpt.read_tensors(tmp_path / "rng", "rng_rank0.safetensors"), manifest["rng"])
    ckpt.restore_rng_state(state)
    again = _draws()
    assert expected[:4] == again[:4] and torch.equal(expected[4], again[4])


def test_malformed_rng_state():
    with pytest.raises(CheckpointError, match="random number generator state is malformed"):
        ckpt.restore_rng_state({"python": {}})


def test_a_file_written_in_place_in_pieces_is_plain_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(6, 5),
        "b": torch.randn(7, dtype=torch.bfloat16),
        "c": torch.arange(4),
        "pad": torch.zeros(0),
    }
    entries = [(k, v.dtype, list(v.shape)) for k, v in tensors.items()]
    path = tmp_path / "part.safetensors"
    offsets = ckpt.create_tensor_file(path, entries)
    assert ckpt.tensor_file_layout(entries)[1] == offsets  # what every other writer computes
    # "a" written as two row ranges (two ranks' shards), the rest whole, in any order
    ckpt.write_into(path, offsets["a"] + 3 * 5 * 4, tensors["a"][3:])
    for key in ("c", "b"):
        ckpt.write_into(path, offsets[key], tensors[key])
    ckpt.write_into(path, offsets["a"], tensors["a"][:3])
    record = ckpt.seal_tensor_file(path)
    assert record["bytes"] == path.stat().st_size
    loaded = safetensors.torch.load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    # the mapped reader too, though "c" (int64 after 14 bytes of bf16) is not 8-byte aligned
    assert offsets["c"] % 8 != 0
    mapped = _map_tensors(path)
    assert all(torch.equal(mapped[k], v) for k, v in tensors.items())
    with pytest.raises(CheckpointError, match="shared file system"):
        ckpt.write_into(tmp_path / "elsewhere.safetensors", 0, tensors["c"])
