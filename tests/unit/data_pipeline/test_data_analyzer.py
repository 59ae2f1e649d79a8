"""DataAnalyzer's index files equal DeepSpeed 0.19.8's byte for byte on a tiny dataset
(reference written by make_deepspeed_reference.py), whatever the worker/thread split."""

import os
import shutil

import pytest
import torch
from make_deepspeed_reference import ANALYZER_KWARGS, analyzer_dataset, seqlen_metric, vocab_metric

from shardwise.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

REFERENCE = os.path.join(os.path.dirname(__file__), "deepspeed_reference", "analyzer")
FINAL_FILES = [
    f"seqlen/seqlen_{name}{ext}"
    for name in ("sample_to_metric", "index_to_metric", "index_to_sample", "index_to_sample_percentile_merged")
    for ext in (".bin", ".idx")
] + ["vocab/vocab_metric_value.bin", "vocab/vocab_metric_value.idx"]


def assert_same_files(save_path, reference=REFERENCE):
    for name in FINAL_FILES:
        with open(os.path.join(save_path, name), "rb") as ours, open(os.path.join(reference, name), "rb") as ref:
            assert ours.read() == ref.read(), name


def _analyze(save_path, num_workers, num_threads, **overrides):
    kwargs = dict(ANALYZER_KWARGS, metric_functions=[seqlen_metric, vocab_metric], save_path=str(save_path))
    kwargs.update(overrides)
    for worker_id in range(num_workers):
        DataAnalyzer(
            analyzer_dataset(), num_workers=num_workers, worker_id=worker_id, num_threads=num_threads, **kwargs
        ).run_map()
    DataAnalyzer(analyzer_dataset(), num_workers=num_workers, num_threads=num_threads, **kwargs).run_reduce()


@pytest.mark.parametrize(("num_workers", "num_threads"), [(2, 1), (1, 3)])
def test_files_equal_deepspeed(tmp_path, num_workers, num_threads):
    _analyze(tmp_path, num_workers, num_threads)
    assert_same_files(tmp_path)
    data = analyzer_dataset()
    index = MMapIndexedDataset(str(tmp_path / "seqlen" / "seqlen_index_to_sample"))
    metric = MMapIndexedDataset(str(tmp_path / "seqlen" / "seqlen_index_to_metric"))
    lengths = seqlen_metric(data)
    for k in range(len(index)):
        assert (lengths[torch.from_numpy(index[k].astype("int64"))] == int(metric[k][0])).all()


def test_map_files_equal_deepspeed_and_reduce_its_map(tmp_path):
    """The per-worker map files are DeepSpeed's too: ours equal its files, and its map
    reduces here into its final files."""
    kwargs = dict(ANALYZER_KWARGS, metric_functions=[seqlen_metric, vocab_metric], save_path=str(tmp_path / "ours"))
    for worker_id in range(2):
        DataAnalyzer(analyzer_dataset(), num_workers=2, worker_id=worker_id, **kwargs).run_map()
    map_root = os.path.join(os.path.dirname(REFERENCE), "analyzer_map")
    for folder, _, names in os.walk(map_root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), map_root)
            with open(os.path.join(map_root, rel), "rb") as want, open(tmp_path / "ours" / rel, "rb") as ours:
                assert ours.read() == want.read(), rel
    shutil.copytree(map_root, tmp_path / "theirs")
    kwargs["save_path"] = str(tmp_path / "theirs")
    DataAnalyzer(analyzer_dataset(), num_workers=2, **kwargs).run_reduce()
    assert_same_files(tmp_path / "theirs")


def test_run_map_reduce_single_worker_without_group(tmp_path):
    kwargs = dict(ANALYZER_KWARGS, metric_functions=[seqlen_metric, vocab_metric], save_path=str(tmp_path))
    DataAnalyzer(analyzer_dataset(), **kwargs).run_map_reduce()
    assert_same_files(tmp_path)


def test_wrong_metric_dtype_is_named(tmp_path):
    with pytest.raises(ValueError, match="returned torch.int64, metric_dtypes says torch.int32"):
        _analyze(tmp_path, 1, 1, metric_dtypes=[torch.int32, torch.int64])


def test_missing_map_part_is_reported(tmp_path):
    kwargs = dict(ANALYZER_KWARGS, metric_functions=[seqlen_metric, vocab_metric], save_path=str(tmp_path))
    DataAnalyzer(analyzer_dataset(), num_workers=2, worker_id=0, **kwargs).run_map()
    with pytest.raises(FileNotFoundError, match="worker1_thread0"):
        DataAnalyzer(analyzer_dataset(), num_workers=2, **kwargs).run_reduce()
