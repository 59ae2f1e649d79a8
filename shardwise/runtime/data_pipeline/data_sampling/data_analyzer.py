"""Build the curriculum index files: map a metric over every sample, reduce into one index.

[Note: the analyzer's files]
For a metric ``m`` of type ``single_value_per_sample`` the reduce writes, under
``<save_path>/m/`` (each an mmap index, see [Note: the mmap index format]):

- ``m_sample_to_metric``: row i = [value of sample i], in dataset order;
- ``m_index_to_metric``: row k = [k-th smallest distinct value];
- ``m_index_to_sample``: row k = the samples whose value is that one (map order);
- ``m_index_to_sample_percentile_merged``: ``m_index_to_sample`` rows concatenated in groups
  of ``max(1, num_values // 100)``, so about 100 rows, one per percentile.

For ``accumulate_value_over_samples`` it writes ``m_metric_value``: one row, the sum of the
metric over all batches. Values use the smallest integer dtype that holds them, sample ids
the smallest that holds ``len(dataset) - 1``. The map step of worker w, thread t leaves its
part under ``m/worker{w}_thread{t}/`` (``m_sample_to_metric`` index, one
``m_metric_to_sample_<value>.csv`` per value, ``m_metric_value``); these are DeepSpeed's
names and contents, so a DeepSpeed map can be reduced here and the other way round, and the
final files are byte-identical to DeepSpeed 0.19.8's for the same ``num_threads_reduce``.
"""

from __future__ import annotations

import csv
import glob
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset, valid_dtypes
from shardwise.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_dataset,
    split_index,
)

SINGLE_VALUE = "single_value_per_sample"
ACCUMULATE = "accumulate_value_over_samples"
_CSV_FLUSH_ROWS = 100  # a value's pending sample ids go to its CSV file past this many


def iterate_batches(dataset, start: int, end: int, batch_size: int, collate_fn):
    """Yield ``(first_sample_idx, batch)`` over ``dataset[start:end]`` in order, collated as a
    DataLoader with a sequential batch sampler would."""
    collate = collate_fn or torch.utils.data.default_collate
    for first in range(start, end, batch_size):
        yield first, collate([dataset[i] for i in range(first, min(first + batch_size, end))])


def metric_tensor(metric_function, data, expected_dtype=None) -> torch.Tensor:
    """Run a metric function and check it returned a tensor or array (of ``expected_dtype``)."""
    values = metric_function(data)
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if not torch.is_tensor(values):
        raise TypeError(f"metric_function must return a tensor or numpy array, got {type(values).__name__}")
    if values.dtype not in valid_dtypes:
        raise ValueError(f"metric values of dtype {values.dtype} cannot be indexed; use one of {valid_dtypes}")
    if expected_dtype is not None and values.dtype != expected_dtype:
        raise ValueError(f"metric_function returned {values.dtype}, metric_dtypes says {expected_dtype}")
    return values


def sample_ids(data, first: int, count: int, sample_indices) -> list[int]:
    """The dataset ids of a batch's rows: ``data["index"]`` (Megatron), else ``sample_indices``
    (a user's shuffle), else the iteration position."""
    if isinstance(data, dict) and "index" in data:
        return [int(data["index"][row][0]) for row in range(count)]
    if sample_indices is not None:
        return [int(sample_indices[first + row]) for row in range(count)]
    return list(range(first, first + count))


def write_rows(fname: str, rows, dtype, doc_ends=()) -> None:
    """Write an index of ``rows`` with a document ending after each row count in ``doc_ends``
    (DeepSpeed's reduce leaves one per reduce chunk) and one at the end."""
    builder = create_mmap_dataset_builder(fname, dtype)
    ends = list(doc_ends)
    for written, row in enumerate(rows):
        while ends and ends[0] == written:
            builder.end_document()
            ends.pop(0)
        builder.add_item_numpy(np.asarray(row))
    for _ in ends:
        builder.end_document()
    close_mmap_dataset_builder(builder, fname)


def _chunk_ends(counts: list[int], num_chunks: int) -> list[int]:
    """Cumulative row count at the end of each of ``num_chunks`` splits of ``counts``."""
    cumulative = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    return [int(cumulative[end]) for _, end in split_index(0, len(counts), num_chunks)]


def write_single_value_index(metric_save_path, metric_name, values, samples_by_value, *, part_sizes, reduce_chunks):
    """Write [Note: the analyzer's files] for one single-value metric.

    Args:
        values: every sample's value, in dataset order (concatenated map parts).
        samples_by_value: ``{value: [sample ids]}`` in map order.
        part_sizes: samples per map part (worker, thread), to place DeepSpeed's document ends.
        reduce_chunks: DeepSpeed's ``num_threads_reduce``, which only moves document ends.
    """
    total = len(values)
    unique = sorted(samples_by_value)
    value_dtype = find_fit_int_dtype(int(unique[0]), int(unique[-1]))
    sample_dtype = find_fit_int_dtype(0, total - 1)
    base = os.path.join(metric_save_path, metric_name)
    write_rows(f"{base}_sample_to_metric", ([v] for v in values), value_dtype, _chunk_ends(part_sizes, reduce_chunks))
    value_ends = _chunk_ends([1] * len(unique), reduce_chunks)
    write_rows(f"{base}_index_to_sample", (samples_by_value[v] for v in unique), sample_dtype, value_ends)
    write_rows(f"{base}_index_to_metric", ([v] for v in unique), value_dtype, value_ends)
    DataAnalyzer.output_index_to_sample_percentile(
        f"{base}_index_to_sample", f"{base}_index_to_metric", metric_name, metric_save_path, total, sample_dtype
    )


def write_accumulated_value(metric_save_path, metric_name, total: np.ndarray) -> None:
    """Write ``<metric>_metric_value``: one row, the summed metric, in the smallest fitting dtype."""
    dtype = find_fit_int_dtype(int(total.min()), int(total.max()))
    write_rows(os.path.join(metric_save_path, f"{metric_name}_metric_value"), [total.astype(np.int64)], dtype)


class DataAnalyzer:
    """Map metric functions over a dataset split among workers and threads; reduce the parts
    into the index files of [Note: the analyzer's files].

    Workers are separate processes or machines sharing ``save_path``: each calls
    ``run_map()`` for its ``worker_id``, then one calls ``run_reduce()``
    (``run_map_reduce()`` does both with barriers). Threads split a worker's range further
    and run as Python threads. Signature and defaults are DeepSpeed 0.19.8's.

    Args:
        metric_types: per metric, ``"single_value_per_sample"`` (the function returns one
            value per sample of the batch) or ``"accumulate_value_over_samples"`` (a tensor
            summed over batches).
        metric_dtypes: per metric, the dtype its function returns (checked).
        custom_map_init / custom_map_update / custom_map_finalize / custom_reduce: replace
            the corresponding built-in step, with DeepSpeed's arguments.
        sample_indices: dataset ids in iteration order, when the dataset is a shuffled view.
        num_threads_reduce: only places document ends in the files as DeepSpeed's
            multi-process reduce does; the reduce itself runs in one thread.
    """

    def __init__(
        self,
        dataset,
        num_workers=1,
        worker_id=0,
        num_threads=1,
        num_threads_reduce=1,
        specific_threads=(),
        batch_size=1,
        metric_names=(),
        metric_functions=(),
        metric_types=(),
        metric_dtypes=(),
        save_path="./",
        collate_fn=None,
        custom_map_init=None,
        custom_map_update=None,
        custom_map_finalize=None,
        custom_reduce=None,
        sample_indices=None,
    ):
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path = str(save_path)
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices
        for metric_type in self.metric_types:
            if metric_type not in (SINGLE_VALUE, ACCUMULATE):
                raise ValueError(f"metric_types: {metric_type!r} is not {SINGLE_VALUE!r} or {ACCUMULATE!r}")

    def init_metric_results(self, thread_id, metric_names, metric_types, metric_dtypes, save_path, worker_id):
        """Open one thread's map outputs: per metric, a dict of builders/paths/pending ids."""
        results = []
        for name, metric_type, dtype in zip(metric_names, metric_types, metric_dtypes):
            if dtype not in valid_dtypes:
                raise ValueError(f"metric_dtypes: {dtype} for {name!r} cannot be indexed; use one of {valid_dtypes}")
            part = os.path.join(save_path, name, f"worker{worker_id}_thread{thread_id}")
            os.makedirs(part, exist_ok=True)
            if metric_type == SINGLE_VALUE:
                to_sample = os.path.join(part, f"{name}_metric_to_sample")
                for stale in glob.glob(f"{glob.escape(to_sample)}*"):
                    os.remove(stale)  # the CSV files are appended to
                sample_to_metric = os.path.join(part, f"{name}_sample_to_metric")
                results.append(
                    {
                        "sample_to_metric_fname": sample_to_metric,
                        "sample_to_metric_builder": create_mmap_dataset_builder(sample_to_metric, dtype),
                        "metric_to_sample_fname": to_sample,
                        "metric_to_sample_dict": defaultdict(list),
                    }
                )
            else:
                results.append({"metric_value": None, "metric_value_fname": os.path.join(part, f"{name}_metric_value")})
        return results

    def update_metric_results(
        self, data, metric_types, metric_dtypes, metric_functions, metric_results, batch_start_idx=0
    ):
        """Add one batch to every metric's map outputs."""
        for metric_type, dtype, function, result in zip(metric_types, metric_dtypes, metric_functions, metric_results):
            values = metric_tensor(function, data, dtype)
            if metric_type == ACCUMULATE:
                result["metric_value"] = (
                    values.clone() if result["metric_value"] is None else result["metric_value"] + values
                )
                continue
            ids = sample_ids(data, batch_start_idx, values.shape[0], self.sample_indices)
            pending = result["metric_to_sample_dict"]
            for row, sample in enumerate(ids):
                result["sample_to_metric_builder"].add_item(values[row].reshape(-1))
                pending[values[row].item()].append(sample)
            _flush_csv(result, min_rows=_CSV_FLUSH_ROWS + 1)

    def finalize_metric_results(self, metric_types, metric_dtypes, metric_results):
        """Close one thread's map outputs."""
        for metric_type, dtype, result in zip(metric_types, metric_dtypes, metric_results):
            if metric_type == SINGLE_VALUE:
                close_mmap_dataset_builder(result["sample_to_metric_builder"], result["sample_to_metric_fname"])
                _flush_csv(result, min_rows=1)
            elif result["metric_value"] is not None:
                fname = result["metric_value_fname"]
                builder = create_mmap_dataset_builder(fname, dtype)
                builder.add_item(result["metric_value"].reshape(-1))
                close_mmap_dataset_builder(builder, fname)

    def run_map_helper(self, thread_id):
        """Map thread ``thread_id``'s range of this worker's samples."""
        start, end = self.thread_splits[thread_id]
        init = self.custom_map_init or self.init_metric_results
        update = self.custom_map_update or self.update_metric_results
        finalize = self.custom_map_finalize or self.finalize_metric_results
        results = init(
            thread_id, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path, self.worker_id
        )
        for first, data in iterate_batches(self.dataset, start, end, self.batch_size, self.collate_fn):
            update(data, self.metric_types, self.metric_dtypes, self.metric_functions, results, first)
        finalize(self.metric_types, self.metric_dtypes, results)

    def run_map(self):
        """Map this worker's share (all its threads, or ``specific_threads``)."""
        self.worker_splits, self.thread_splits = split_dataset(
            self.dataset, self.num_workers, self.worker_id, self.num_threads
        )
        threads = self.specific_threads or list(range(self.num_threads))
        if len(threads) == 1:
            self.run_map_helper(threads[0])
            return
        with ThreadPoolExecutor(max_workers=len(threads)) as pool:
            for done in [pool.submit(self.run_map_helper, t) for t in threads]:
                done.result()

    def run_reduce(self):
        """Merge every worker's and thread's map outputs into the final index files."""
        if self.custom_reduce is not None:
            self.custom_reduce(
                self.dataset,
                self.metric_names,
                self.metric_types,
                self.save_path,
                self.num_workers,
                self.num_threads,
                self.num_threads_reduce,
            )
            return
        parts = [(w, t) for w in range(self.num_workers) for t in range(self.num_threads)]
        for name, metric_type in zip(self.metric_names, self.metric_types):
            metric_save_path = os.path.join(self.save_path, name)
            if metric_type == SINGLE_VALUE:
                self._reduce_single_value(metric_save_path, name, parts)
            else:
                total = None
                for w, t in parts:
                    part = MMapIndexedDataset(
                        os.path.join(metric_save_path, f"worker{w}_thread{t}", f"{name}_metric_value")
                    )
                    total = np.array(part[0], dtype=np.int64) if total is None else total + part[0]
                write_accumulated_value(metric_save_path, name, total)

    def _reduce_single_value(self, metric_save_path, name, parts):
        values, part_sizes, samples_by_value = [], [], {}
        for w, t in parts:
            part = MMapIndexedDataset(
                os.path.join(metric_save_path, f"worker{w}_thread{t}", f"{name}_sample_to_metric")
            )
            part_values = np.concatenate(part[:]) if len(part) else np.empty(0, np.int64)
            values.append(part_values)
            part_sizes.append(len(part_values))
        values = np.concatenate(values)
        if len(values) != len(self.dataset):
            raise ValueError(
                f"the map parts under {metric_save_path} hold {len(values)} samples, the dataset has "
                f"{len(self.dataset)}: a map worker did not finish, or the parts are from another dataset"
            )
        for value in np.unique(values).tolist():
            ids = []
            for w, t in parts:
                path = os.path.join(metric_save_path, f"worker{w}_thread{t}", f"{name}_metric_to_sample_{value}.csv")
                if os.path.isfile(path):
                    with open(path, newline="") as f:
                        ids.extend(int(x) for row in csv.reader(f) for x in row)
            samples_by_value[value] = ids
        write_single_value_index(
            metric_save_path,
            name,
            values.tolist(),
            samples_by_value,
            part_sizes=part_sizes,
            reduce_chunks=self.num_threads_reduce,
        )

    def run_map_reduce(self, comm_group=None):
        """``run_map()`` on every worker, then ``run_reduce()`` on worker 0, with barriers over
        ``comm_group`` in between (none needed for a single worker without a process group)."""
        from shardwise import comm as dist

        synced = dist.is_initialized()
        if not synced and self.num_workers > 1:
            raise RuntimeError("run_map_reduce with num_workers > 1 needs an initialized process group")
        self.run_map()
        if synced:
            dist.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if synced:
            dist.barrier(group=comm_group)

    @staticmethod
    def output_index_to_sample_percentile(
        index_to_sample_fname, index_to_metric_fname, metric_name, metric_save_path, total_num_samples, sample_idx_dtype
    ):
        """Write ``<metric>_index_to_sample_percentile_merged`` (see [Note: the analyzer's files]);
        return ``{value: number of samples}``."""
        index_to_sample = MMapIndexedDataset(index_to_sample_fname)
        index_to_metric = MMapIndexedDataset(index_to_metric_fname)
        metric_values = [int(index_to_metric[k][0]) for k in range(len(index_to_metric))]
        if any(b <= a for a, b in zip(metric_values, metric_values[1:])):
            raise ValueError(f"{index_to_metric_fname}: values are not strictly increasing")
        counts = {v: int(index_to_sample.sizes[k]) for k, v in enumerate(metric_values)}
        if sum(counts.values()) != total_num_samples:
            raise ValueError(
                f"{index_to_sample_fname} holds {sum(counts.values())} samples, expected {total_num_samples}"
            )
        step = max(1, len(index_to_sample) // 100)
        merged = (np.concatenate(index_to_sample[k : k + step]) for k in range(0, len(index_to_sample), step))
        write_rows(
            os.path.join(metric_save_path, f"{metric_name}_index_to_sample_percentile_merged"), merged, sample_idx_dtype
        )
        return counts


def _flush_csv(result: dict, *, min_rows: int) -> None:
    """Append each value's pending sample ids (at least ``min_rows`` of them) to its CSV file."""
    pending = result["metric_to_sample_dict"]
    for value, ids in pending.items():
        if len(ids) >= min_rows:
            with open(f"{result['metric_to_sample_fname']}_{value}.csv", "a", newline="") as f:
                csv.writer(f).writerow(ids)
            pending[value] = []


class DistributedDataAnalyzer:
    """The analyzer over the ranks of a process group: each rank maps its share in memory,
    rank 0 gathers the values and writes the same files as one ``DataAnalyzer`` would
    (see [Note: the analyzer's files]). Signature and defaults are DeepSpeed 0.19.8's.

    Args:
        comm_group: the group whose ranks are the workers; None uses ``num_workers`` and
            ``worker_id`` over the default group.
        device: accepted for DeepSpeed's signature; values are gathered as CPU objects.
    """

    def __init__(
        self,
        dataset,
        num_workers=1,
        num_threads=1,
        worker_id=0,
        batch_size=1,
        metric_names=(),
        metric_functions=(),
        metric_types=(),
        save_path="./",
        collate_fn=None,
        device="cuda",
        comm_group=None,
        sample_indices=None,
    ) -> None:
        from shardwise import comm as dist

        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.save_path = list(metric_types), str(save_path)
        self.device, self.sample_indices, self.num_threads = device, sample_indices, num_threads or 1
        self.comm_group = comm_group
        if comm_group is None:
            self.num_workers, self.worker_id = num_workers, worker_id
        else:
            self.num_workers, self.worker_id = dist.get_world_size(comm_group), dist.get_rank(comm_group)
        for metric_type in self.metric_types:
            if metric_type not in (SINGLE_VALUE, ACCUMULATE):
                raise ValueError(f"metric_types: {metric_type!r} is not {SINGLE_VALUE!r} or {ACCUMULATE!r}")

    def run_map_helper(self, thread_id=0):
        """Map one thread's range: per metric, ``(values, sample ids)`` arrays or a summed array."""
        start, end = self.thread_splits[thread_id]
        results = [([], []) if t == SINGLE_VALUE else None for t in self.metric_types]
        for first, data in iterate_batches(self.dataset, start, end, self.batch_size, self.collate_fn):
            for m, (metric_type, function) in enumerate(zip(self.metric_types, self.metric_functions)):
                values = metric_tensor(function, data)
                if metric_type == ACCUMULATE:
                    results[m] = values.clone() if results[m] is None else results[m] + values
                else:
                    results[m][0].extend(values.reshape(values.shape[0], -1)[:, 0].tolist())
                    results[m][1].extend(sample_ids(data, first, values.shape[0], self.sample_indices))
        return [r if isinstance(r, tuple) else (None if r is None else r.numpy()) for r in results]

    def run_map_reduce(self):
        """Map on every rank, gather on all, write on rank 0, then a barrier."""
        from shardwise import comm as dist

        self.worker_splits, self.thread_splits = split_dataset(
            self.dataset, self.num_workers, self.worker_id, self.num_threads
        )
        with ThreadPoolExecutor(max_workers=self.num_threads) as pool:
            mine = list(pool.map(self.run_map_helper, range(self.num_threads)))
        gathered = [None] * self.num_workers
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine, group=self.comm_group)
        else:
            gathered = [mine]
        if self.worker_id == 0:
            parts = [thread for worker in gathered for thread in worker]
            for m, name in enumerate(self.metric_names):
                self._write_metric(name, self.metric_types[m], [part[m] for part in parts])
        if dist.is_initialized():
            dist.barrier(group=self.comm_group)

    def _write_metric(self, name, metric_type, parts):
        metric_save_path = os.path.join(self.save_path, name)
        os.makedirs(metric_save_path, exist_ok=True)
        if metric_type == ACCUMULATE:
            sums = [p.astype(np.int64) for p in parts if p is not None]
            write_accumulated_value(metric_save_path, name, sum(sums[1:], sums[0]))
            return
        samples_by_value = defaultdict(list)
        for values, ids in parts:
            for value, sample in zip(values, ids):
                samples_by_value[value].append(sample)
        values = [v for part_values, _ in parts for v in part_values]
        write_single_value_index(
            metric_save_path, name, values, samples_by_value, part_sizes=[len(v) for v, _ in parts], reduce_chunks=1
        )
