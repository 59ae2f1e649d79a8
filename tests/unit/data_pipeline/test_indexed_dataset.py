"""The mmap index format: files DeepSpeed wrote read identically here, ours are byte-identical
to DeepSpeed's for the same rows, and missing or damaged files are named with the command
that makes them."""

import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from shardwise.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
)

REFERENCE = os.path.join(os.path.dirname(__file__), "deepspeed_reference")
ROWS = [[1, 2, 3], [], [65535, 0], [7] * 5, [4]]  # as make_deepspeed_reference.py writes them


def _write_rows(prefix, dtype=np.uint16):
    builder = create_mmap_dataset_builder(prefix, dtype)
    for i, row in enumerate(ROWS):
        builder.add_item_numpy(np.array(row))
        if i == 2:
            builder.end_document()
    close_mmap_dataset_builder(builder, prefix)


def test_reads_deepspeed_file():
    ds = MMapIndexedDataset(os.path.join(REFERENCE, "rows"), skip_warmup=True)
    assert len(ds) == len(ROWS) and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == ROWS
    assert ds[np.int64(3)].tolist() == ROWS[3] and ds[-1].tolist() == ROWS[-1]
    assert [r.tolist() for r in ds[1:4]] == ROWS[1:4]
    assert ds.doc_idx.tolist() == [0, 3, 5]
    assert ds.sizes.tolist() == [len(r) for r in ROWS]
    assert ds.get(3, offset=1, length=2).tolist() == [7, 7]
    assert [r.tolist() for r in pickle.loads(pickle.dumps(ds))] == ROWS
    with pytest.raises(IndexError):
        ds[len(ROWS)]


def test_written_files_equal_deepspeed_bytes(tmp_path):
    _write_rows(str(tmp_path / "rows"))
    for ext in (".bin", ".idx"):
        with open(tmp_path / f"rows{ext}", "rb") as ours, open(os.path.join(REFERENCE, f"rows{ext}"), "rb") as ref:
            assert ours.read() == ref.read(), ext


def test_builder_merge_and_torch_items(tmp_path):
    _write_rows(str(tmp_path / "a"), np.int64)
    builder = create_mmap_dataset_builder(str(tmp_path / "b"), torch.int64)
    builder.add_item(torch.tensor([9, 8]))
    builder.merge_file_(str(tmp_path / "a"))
    close_mmap_dataset_builder(builder, str(tmp_path / "b"))
    merged = MMapIndexedDataset(str(tmp_path / "b"))
    assert [r.tolist() for r in merged] == [[9, 8], *ROWS]
    assert merged.doc_idx.tolist() == [0, 4, 6, 6]


def test_missing_file_names_it_and_the_analyzer(tmp_path):
    shutil.copy(os.path.join(REFERENCE, "rows.idx"), tmp_path / "rows.idx")
    with pytest.raises(FileNotFoundError, match=r"rows\.bin does not exist.*DataAnalyzer\(.*run_map_reduce"):
        MMapIndexedDataset(str(tmp_path / "rows"))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda idx, b: (b"XXXXXXXXX" + idx[9:], b), "magic"),
        (lambda idx, b: (idx[:9] + (2).to_bytes(8, "little") + idx[17:], b), "version"),
        (lambda idx, b: (idx[:17] + bytes([99]) + idx[18:], b), "dtype code 99"),
        (lambda idx, b: (idx[:-3], b), "header promises"),
        (lambda idx, b: (idx, b[:-2]), "index describes"),
    ],
    ids=["magic", "version", "dtype", "truncated_idx", "truncated_bin"],
)
def test_damaged_file_is_named(tmp_path, damage, why):
    with open(os.path.join(REFERENCE, "rows.idx"), "rb") as f_idx, open(os.path.join(REFERENCE, "rows.bin"), "rb") as f:
        idx, data = damage(f_idx.read(), f.read())
    (tmp_path / "rows.idx").write_bytes(idx)
    (tmp_path / "rows.bin").write_bytes(data)
    with pytest.raises(ValueError, match=rf"rows\.(idx|bin) is damaged.*{why}.*DataAnalyzer"):
        MMapIndexedDataset(str(tmp_path / "rows"))


def test_find_fit_int_dtype():
    cases = [(0, 255, np.uint8), (0, 256, np.uint16), (0, 2**32, np.uint64), (-1, 127, np.int8), (-129, 0, np.int16)]
    assert [find_fit_int_dtype(lo, hi) for lo, hi, _ in cases] == [want for _, _, want in cases]
