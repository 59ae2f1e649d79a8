"""DeepSpeed's curriculum data sampler: global batches drawn from clusters of samples that a
difficulty schedule admits, one slice per data-parallel rank.

[Note: curriculum clusters]
At every global batch the curriculum step advances and each metric's scheduler gives a
difficulty. When one changes, the samples it newly admits become a new cluster (for a
single clustered metric: values in (previous, current] or percentiles in the same range;
for several: the intersection of what each admits, minus the older clusters), shuffled and
written to ``<data_cluster_path>/cluster_<metric><difficulty>...`` (.bin/.idx). A global
batch draws ``global_batch_size`` cluster ids with probability proportional to cluster
size, takes that many samples from each cluster at its read position (reshuffling and
starting over when a cluster is exhausted, so no sample repeats before its cluster is
used up), and shuffles the batch. Data-parallel rank 0 decides and broadcasts the batch;
each rank yields its contiguous slice of every micro-batch row. The random draws are the
same calls, in the same order, as DeepSpeed 0.19.8's, so a seed gives the same batches.

Unlike DeepSpeed (which saves numpy's global random state), ``state_dict`` saves the
sampler's own generator, so a resumed run continues with exactly the batches an
uninterrupted run would have drawn.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np

from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from shardwise.runtime.data_pipeline.data_sampling.utils import find_fit_int_dtype, write_index_atomically

logger = logging.getLogger(__name__)

# DeepSpeed 0.19.8's defaults, for dicts that omit the keys (its parsed config fills them in)
_NUM_EPOCHS_DEFAULT = 1000
_SEED_DEFAULT = 1234
_STATE_KEYS = (
    "batch",
    "consumed_samples",
    "curriculum_step",
    "current_difficulties",
    "data_cluster_paths",
    "data_cluster_current_position",
    "np_rng_state",
)


def samples_by_value(index_to_sample, index_to_metric, low, high) -> np.ndarray | None:
    """The samples whose metric value is in ``(low, high]``, in index order (None if none)."""
    rows = [np.asarray(index_to_sample[k]) for k in range(len(index_to_sample)) if low < index_to_metric[k][0] <= high]
    return np.concatenate(rows) if rows else None


def samples_by_percentile(index_to_sample, start, end, max_percentile) -> np.ndarray | None:
    """The samples ranked (by metric value, index order) in percentiles ``(start, end]``:
    positions ``[total // max_percentile * start, ... * end)``, the last range to the end."""
    total = int(np.sum(index_to_sample.sizes, dtype=np.int64))
    per_percentile = total // max_percentile
    first, last = per_percentile * start, (total if end == max_percentile else per_percentile * end)
    rows, seen = [], 0
    for k in range(len(index_to_sample)):
        size = int(index_to_sample.sizes[k])
        if seen + size > first:
            rows.append(np.asarray(index_to_sample[k][max(0, first - seen) : min(size, last - seen)]))
        seen += size
        if seen >= last:
            break
    return np.concatenate(rows) if rows else None


class DeepSpeedDataSampler:
    """A batch sampler (``DataLoader(batch_sampler=...)``) following a curriculum; see
    [Note: curriculum clusters]. Signature and config keys are DeepSpeed 0.19.8's.

    Args:
        data_efficiency_config: DeepSpeed's ``data_efficiency`` dict (``seed``,
            ``data_sampling.num_epochs``, ``data_sampling.curriculum_learning`` with
            ``data_cluster_path`` and ``curriculum_metrics``).
        one_epoch_total_samples: dataset length; the sampler yields
            ``num_epochs`` times as many samples.
        data_parallel_group: the group to broadcast over; None with
            ``data_parallel_size`` 1 needs no process group.
        drop_last: drop a last micro-batch row shorter than ``micro_batch_size * dp``.
    """

    def __init__(
        self,
        data_efficiency_config,
        one_epoch_total_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
        data_parallel_group,
        gradient_accumulation_steps,
        global_rank,
        drop_last=True,
    ):
        sampling = data_efficiency_config["data_sampling"]
        curriculum = sampling.get("curriculum_learning", {})
        if not curriculum.get("enabled", False):
            raise ValueError("DeepSpeedDataSampler needs data_sampling.curriculum_learning.enabled = true")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        if micro_batch_size <= 0 or one_epoch_total_samples <= 0:
            raise ValueError(
                f"micro_batch_size {micro_batch_size} and one_epoch_total_samples {one_epoch_total_samples} must be > 0"
            )
        self.data_efficiency_config = data_efficiency_config
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * sampling.get("num_epochs", _NUM_EPOCHS_DEFAULT)
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples)
        self.micro_batch_size, self.drop_last = micro_batch_size, drop_last
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.data_parallel_group, self.global_rank = data_parallel_group, global_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.np_rng = np.random.default_rng(data_efficiency_config.get("seed", _SEED_DEFAULT))
        self.cluster_root = curriculum.get("data_cluster_path", "")
        self.metrics: dict = dict(curriculum["curriculum_metrics"])
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.data_clusters: list[np.ndarray] = []  # decider only: each cluster's current order
        self.curriculum_schedulers = self._schedulers()
        self._index_to_sample, self._index_to_metric = {}, {}
        if self._decides:
            self._open_indexes()

    @property
    def _decides(self) -> bool:
        return self.data_parallel_rank == 0

    def _schedulers(self) -> dict:
        from shardwise.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

        return {name: CurriculumScheduler(cfg, name=f"curriculum_metrics.{name}") for name, cfg in self.metrics.items()}

    def _open_indexes(self) -> None:
        os.makedirs(self.cluster_root, exist_ok=True)
        for name, cfg in self.metrics.items():
            if cfg.get("clustering_type") == "single_cluster":
                continue
            self._index_to_sample[name] = MMapIndexedDataset(cfg["index_to_sample_path"], skip_warmup=True)
            if cfg["difficulty_type"] == "value":
                self._index_to_metric[name] = MMapIndexedDataset(cfg["index_to_metric_path"], skip_warmup=True)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping) -> None:
        """Give metrics with ``schedule_type: custom`` their ``fn(step) -> difficulty``."""
        for name, scheduler in self.curriculum_schedulers.items():
            if name in schedule_func_dict:
                scheduler.set_custom_get_difficulty(schedule_func_dict[name])

    def get_start_end_idx(self, batch_len=None) -> tuple[int, int]:
        """This rank's ``[start, end)`` within a micro-batch row of ``batch_len`` samples."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        bound = lambda r: round(r * batch_len / self.data_parallel_size)  # noqa: E731
        return bound(self.data_parallel_rank), bound(self.data_parallel_rank + 1)

    def _admitted(self, name, low, high) -> np.ndarray | None:
        cfg = self.metrics[name]
        if cfg["difficulty_type"] == "value":
            return samples_by_value(self._index_to_sample[name], self._index_to_metric[name], low, high)
        return samples_by_percentile(self._index_to_sample[name], low, high, cfg["max_difficulty"])

    def _new_cluster_samples(self, previous: dict) -> np.ndarray | None:
        """The samples the difficulty change admits (see [Note: curriculum clusters])."""
        clustered = [n for n, cfg in self.metrics.items() if cfg.get("clustering_type") != "single_cluster"]
        everything = np.arange(self.one_epoch_total_samples, dtype=self.index_dtype)
        if len(clustered) > 1:
            new = None
            for name in self.metrics:
                start = float("-inf") if self.metrics[name]["difficulty_type"] == "value" else 0
                admitted = (
                    everything
                    if name not in clustered
                    else self._admitted(name, start, self.current_difficulties[name])
                )
                new = admitted if new is None else np.intersect1d(new, admitted, assume_unique=True)
            for cluster in self.data_clusters:
                new = np.setdiff1d(new, cluster, assume_unique=True)
            return new
        new = everything if not self.data_clusters else None
        for name in clustered:
            new = self._admitted(name, previous[name], self.current_difficulties[name])
        return new

    def _cluster_name(self) -> str:
        return "cluster" + "".join(f"_{name}{self.current_difficulties[name]}" for name in self.metrics)

    def _add_cluster(self, previous: dict) -> str | None:
        """Decider: build, shuffle and write the new cluster; its file name, or None if empty."""
        new = self._new_cluster_samples(previous)
        if new is None or len(new) == 0:
            logger.info("curriculum %s admits no new samples; no cluster added", self.current_difficulties)
            return None
        new = np.array(new, dtype=self.index_dtype)
        self.np_rng.shuffle(new)
        name = self._cluster_name()
        write_index_atomically(os.path.join(self.cluster_root, name), [new], self.index_dtype)
        self.data_clusters.append(new)
        return name

    def _take(self, cidx: int, count: int) -> list[int]:
        """Decider: ``count`` samples from cluster ``cidx``, reshuffling it when exhausted."""
        start = self.data_cluster_current_position[cidx]
        taken = self.data_clusters[cidx][start : start + count].tolist()
        self.data_cluster_current_position[cidx] += count
        if len(taken) < count:
            reshuffled = np.copy(self.data_clusters[cidx])
            self.np_rng.shuffle(reshuffled)
            write_index_atomically(
                os.path.join(self.cluster_root, self.data_cluster_paths[cidx]), [reshuffled], self.index_dtype
            )
            self.data_clusters[cidx] = reshuffled
            remaining = count - len(taken)
            taken += reshuffled[:remaining].tolist()
            self.data_cluster_current_position[cidx] = remaining
        return taken

    def _draw_global_batch(self) -> list[int]:
        """Decider: cluster counts proportional to size, samples from each, shuffled."""
        sizes = [len(c) for c in self.data_clusters]
        if not sizes:
            raise ValueError(
                f"the curriculum admits no samples at step {self.curriculum_step} (difficulties "
                f"{self.current_difficulties}): check min_difficulty against the values in the index files"
            )
        weights = [s / sum(sizes) for s in sizes]
        picks = self.np_rng.choice(len(sizes), self.global_batch_size, replace=True, p=weights)
        batch = []
        for cidx, count in enumerate(np.bincount(picks, minlength=len(sizes))):
            batch += self._take(cidx, int(count))
        self.np_rng.shuffle(batch)
        return batch

    def _advance_schedule(self) -> dict | None:
        """Step the schedulers; the previous difficulties if one changed, else None."""
        self.curriculum_step += 1
        previous, changed = {}, False
        for name, scheduler in self.curriculum_schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            start = float("-inf") if self.metrics[name]["difficulty_type"] == "value" else 0
            changed |= self.current_difficulties.get(name) != difficulty
            previous[name] = self.current_difficulties.get(name, start)
            self.current_difficulties[name] = difficulty
        return previous if changed else None

    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and fetch the next global batch into ``self.batch``."""
        previous = self._advance_schedule()
        decision = None
        if self._decides:
            cluster = self._add_cluster(previous) if previous is not None else None
            if cluster is not None:
                self.data_cluster_paths.append(cluster)
                self.data_cluster_current_position.append(0)
            decision = (cluster, self._draw_global_batch())
        cluster, self.batch = self._broadcast(decision)
        if cluster is not None and not self._decides:
            self.data_cluster_paths.append(cluster)
            self.data_cluster_current_position.append(0)

    def _broadcast(self, decision):
        if self.data_parallel_size == 1:
            return decision
        from shardwise import comm as dist

        box = [decision]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(self.data_parallel_group, 0), group=self.data_parallel_group
        )
        cluster, batch = box[0]
        return cluster, [int(i) for i in batch]

    def __iter__(self):
        row = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current, self.batch = self.batch[:row], self.batch[row:]
            if len(current) == row or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                self.consumed_samples += len(current)
                yield current[start:end]

    def state_dict(self) -> dict:
        """DeepSpeed's keys; ``np_rng_state`` is the sampler's own generator state."""
        return {
            "batch": list(self.batch),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
            "data_cluster_paths": list(self.data_cluster_paths),
            "data_cluster_current_position": list(self.data_cluster_current_position),
            "np_rng_state": self.np_rng.bit_generator.state,
        }

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Resume from ``state_dict()`` (ours or DeepSpeed's); cluster files are read from
        ``data_cluster_path`` by name, so the folder may have moved."""
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"data sampler state lacks {missing}")
        self.batch = list(state_dict["batch"])
        self.consumed_samples = state_dict["consumed_samples"]
        self.curriculum_step = state_dict["curriculum_step"]
        self.current_difficulties = dict(state_dict["current_difficulties"])
        self.data_cluster_paths = [os.path.basename(p) for p in state_dict["data_cluster_paths"]]
        self.data_cluster_current_position = list(state_dict["data_cluster_current_position"])
        rng_state = state_dict["np_rng_state"]
        if isinstance(rng_state, Mapping):
            self.np_rng.bit_generator.state = rng_state
        else:
            logger.warning(
                "this data sampler state comes from DeepSpeed, which saved numpy's global random state "
                "instead of the sampler's generator: the resumed batches differ from an uninterrupted run"
            )
        if self._decides:
            self.data_clusters = [
                np.array(MMapIndexedDataset(os.path.join(self.cluster_root, name))[0])
                for name in self.data_cluster_paths
            ]
