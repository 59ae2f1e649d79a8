"""Small helpers shared by the analyzer and the sampler, at DeepSpeed's names."""

from __future__ import annotations

import os

import numpy as np

from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)


def find_fit_int_dtype(min_value: int, max_value: int) -> type:
    """The smallest numpy integer type holding ``[min_value, max_value]`` (unsigned when min >= 0)."""
    candidates = (
        (np.uint8, np.uint16, np.uint32, np.uint64) if min_value >= 0 else (np.int8, np.int16, np.int32, np.int64)
    )
    for dtype in candidates:
        info = np.iinfo(dtype)
        if info.min <= min_value and max_value <= info.max:
            return dtype
    return candidates[-1]


def split_index(start_idx: int, end_idx: int, num_partitions: int) -> list[tuple[int, int]]:
    """``num_partitions`` contiguous ``(start, end)`` ranges covering ``[start_idx, end_idx)``.

    The boundaries are ``linspace`` truncated to int, as DeepSpeed splits, so both libraries
    give each worker the same samples.
    """
    bounds = np.linspace(start_idx, end_idx, num=num_partitions + 1, dtype=int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(num_partitions)]


def split_dataset(dataset, num_workers: int, worker_id: int, num_threads: int):
    """Every worker's range of ``dataset`` and this worker's range split over its threads."""
    worker_splits = split_index(0, len(dataset), num_workers)
    start, end = worker_splits[worker_id]
    return worker_splits, split_index(start, end, num_threads)


def create_mmap_dataset_builder(fname: str, dtype) -> MMapIndexedDatasetBuilder:
    """A builder writing ``<fname>.bin``; finish it with :func:`close_mmap_dataset_builder`."""
    return MMapIndexedDatasetBuilder(data_file_path(fname), dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    """End the builder's one document and write ``<fname>.idx``."""
    builder.end_document()
    builder.finalize(index_file_path(fname))


def write_index_atomically(fname: str, rows, dtype) -> None:
    """Write the index ``fname`` from ``rows`` (numpy arrays) without touching the old files
    until the new ones are complete, so a reader that mapped the old ones keeps valid pages."""
    tmp = f"{fname}.tmp{os.getpid()}"
    builder = create_mmap_dataset_builder(tmp, dtype)
    builder.add_items(rows)
    close_mmap_dataset_builder(builder, tmp)
    os.replace(data_file_path(tmp), data_file_path(fname))
    os.replace(index_file_path(tmp), index_file_path(fname))
