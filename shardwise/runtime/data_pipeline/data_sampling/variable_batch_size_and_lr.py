"""Dynamic batching: micro-batches filled up to a token budget from each sample's length, and
a learning rate scaled to each batch's size (DeepSpeed 0.19.8's ``data_sampling.dynamic_batching``).

[Note: token-budget batches]
Samples are taken in ``sequence_picking_order`` ("dataloader": dataset order, "seqlen":
shortest first, "random": a seeded shuffle); one longer than ``max_tokens`` is dropped with
a warning. Each batch of ``effective_batch_size`` micro-batches is the longest run of the
remaining samples that, dealt round-robin into its micro-batches (every micro-batch the
same number of samples when ``required_microbatches_of_same_size``, for pipelines), keeps
every micro-batch within ``max_tokens`` and within ``[min_batch_size, max_batch_size]``
samples. Micro-batches past the last whole batch are dropped. This is DeepSpeed's packing,
except that DeepSpeed never places the last sample of the order (its scan stops one short);
here it is packed like the others.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

logger = logging.getLogger(__name__)

_PICKING_ORDERS = ("dataloader", "seqlen", "random")
_LR_SCALING = ("linear", "sqrt", "none")


def _pick_order(seqlens, ids, order, seed):
    if order not in _PICKING_ORDERS:
        raise ValueError(f"dynamic_batching.sequence_picking_order must be one of {_PICKING_ORDERS}, got {order!r}")
    metrics = [(seqlens[i], i) for i in ids]
    if order == "random":
        random.Random(seed).shuffle(metrics)
    elif order == "seqlen":
        metrics.sort()
    return metrics


def _longest_batch(metrics, start, multiple, fits) -> int:
    """End of the longest valid batch from ``start`` (ends step by ``multiple``); ``start`` if none."""
    best = start
    for end in range(start + multiple, len(metrics) + 1, multiple):
        batch = metrics[start:end]
        if all(fits(batch[b::multiple]) for b in range(multiple)):
            best = end
        elif best > start:
            break  # token sums and counts only grow: nothing longer fits again
    return best


def batch_by_seqlens(
    seqlens,
    max_tokens,
    sequence_ids_per_mb=None,
    min_batch_size=1,
    max_batch_size=None,
    sequence_picking_order="dataloader",
    effective_batch_size=1,
    required_microbatches_of_same_size=False,
    verbose=False,
    seed=None,
):
    """Pack samples into micro-batches under a token budget (see [Note: token-budget batches]).

    Args:
        seqlens: each sample's length (or any additive cost).
        sequence_ids_per_mb: the sample ids to use (default: all).
        effective_batch_size: micro-batches per batch (micro-batches per rank x ranks x
            accumulation steps).

    Returns:
        ``(microbatch_ids, batch_sizes, batch_max_seqlens)``: per micro-batch
        ``(batch id, [sample ids])``; per batch its number of samples and its longest sample.
    """
    ids = range(len(seqlens)) if sequence_ids_per_mb is None else sequence_ids_per_mb
    metrics = _pick_order(seqlens, ids, sequence_picking_order, seed)
    too_long = [i for length, i in metrics if length > max_tokens]
    if too_long:
        logger.warning("dynamic batching drops samples %s: each is longer than max_tokens %s", too_long, max_tokens)
        metrics = [m for m in metrics if m[0] <= max_tokens]

    def fits(mb):
        if (min_batch_size and len(mb) < min_batch_size) or (max_batch_size and len(mb) > max_batch_size):
            return False
        return sum(length for length, _ in mb) <= max_tokens

    multiple = effective_batch_size if required_microbatches_of_same_size else 1
    microbatches, start = [], 0
    while start < len(metrics):
        end = _longest_batch(metrics, start, multiple, fits)
        if end == start:
            break
        microbatches += [metrics[start:end][b::multiple] for b in range(multiple)]
        start = end
    if len(microbatches) < effective_batch_size:
        raise ValueError(
            f"dynamic batching made {len(microbatches)} micro-batches, fewer than one batch of "
            f"{effective_batch_size}: raise max_tokens or lower min_batch_size"
        )
    microbatches = microbatches[: len(microbatches) - len(microbatches) % effective_batch_size]
    microbatch_ids, batch_sizes, batch_max_seqlens = [], [], []
    for batch_id, first in enumerate(range(0, len(microbatches), effective_batch_size)):
        mbs = microbatches[first : first + effective_batch_size]
        microbatch_ids += [(batch_id, [i for _, i in mb]) for mb in mbs]
        batch_sizes.append(sum(len(mb) for mb in mbs))
        batch_max_seqlens.append(max(length for mb in mbs for length, _ in mb))
        if verbose:
            logger.info(
                "batch %d: samples per micro-batch %s, tokens per micro-batch %s",
                batch_id,
                [len(mb) for mb in mbs],
                [sum(n for n, _ in mb) for mb in mbs],
            )
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size, batch_size, base_lr=1, method="linear"):
    """The learning rate for ``batch_size`` given ``base_lr`` at ``base_batch_size``: linear
    (Goyal et al.), sqrt (Krizhevsky), or "none"/None (unchanged)."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or str(method).lower() == "none":
        return base_lr
    raise ValueError(f"dynamic_batching.lr_scaling_method must be one of {_LR_SCALING}, got {method!r}")


def dataloader_for_variable_batch_size(
    dataset,
    microbatch_ids,
    batch_max_seqlens,
    dataloader_rank=0,
    dataloader_batch_size=1,
    dataloader_num_replicas=1,
    dataloader_collate_fn=None,
    dataloader_num_workers=2,
    dataloader_pin_memory=False,
    required_microbatches_of_same_seqlen=False,
    sample_padding_fn=None,
):
    """A DataLoader over this rank's micro-batches (dealt round-robin to the replicas); each
    item collates the samples of ``dataloader_batch_size`` micro-batches, padded to their
    batch's longest sample by ``sample_padding_fn(sample, length)`` when
    ``required_microbatches_of_same_seqlen``. Returns ``(dataloader, deepspeed_io_kwargs)``."""
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise ValueError("required_microbatches_of_same_seqlen needs a sample_padding_fn(sample, length)")
    sampler = DistributedSampler(
        microbatch_ids, num_replicas=dataloader_num_replicas, rank=dataloader_rank, shuffle=False, drop_last=False
    )

    def collate(items):
        samples = []
        for batch_id, ids in items:
            batch = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                batch = [sample_padding_fn(s, batch_max_seqlens[batch_id]) for s in batch]
            samples += batch
        return dataloader_collate_fn(samples) if dataloader_collate_fn else samples

    kwargs = dict(
        batch_size=dataloader_batch_size, sampler=sampler, collate_fn=collate, pin_memory=dataloader_pin_memory
    )
    dataloader = DataLoader(microbatch_ids, num_workers=dataloader_num_workers, **kwargs)
    io_kwargs = dict(
        dataset=microbatch_ids,
        batch_size=dataloader_batch_size,
        pin_memory=dataloader_pin_memory,
        data_sampler=sampler,
        collate_fn=collate,
        num_local_io_workers=dataloader_num_workers,
    )
    return dataloader, io_kwargs


class VariableBatchSizeLR:
    """Wraps an LR scheduler: after each step, each param group's learning rate is the
    wrapped scheduler's value scaled (``scale_lr``) to the coming batch's size.

    The wrapped scheduler always steps from its unscaled values. ``batch_sizes`` wrap
    around after the last batch.
    """

    def __init__(
        self,
        lr_scheduler,
        base_batch_size,
        batch_sizes,
        dataloader=None,
        lr_scaling_method="linear",
        last_epoch=-1,
        verbose=False,
    ):
        scale_lr(1, 1, 1, lr_scaling_method)  # validate the method now
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size, self.batch_sizes = base_batch_size, list(batch_sizes)
        self.lr_scaling_method, self.dataloader, self.verbose = lr_scaling_method, dataloader, verbose
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self._unscaled = list(self.base_lrs)
        self.last_epoch = last_epoch + 1
        self._scale()

    @property
    def optimizer(self):
        return self.base_lr_scheduler.optimizer

    def _scale(self) -> None:
        batch_size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group, lr in zip(self.optimizer.param_groups, self._unscaled):
            group["lr"] = scale_lr(self.base_batch_size, batch_size, lr, self.lr_scaling_method)

    def step(self) -> None:
        """Step the wrapped scheduler from its unscaled rates, then scale for the next batch."""
        for group, lr in zip(self.optimizer.param_groups, self._unscaled):
            group["lr"] = lr
        self.base_lr_scheduler.step()
        self._unscaled = [group["lr"] for group in self.optimizer.param_groups]
        self.last_epoch += 1
        self._scale()

    def get_last_lr(self) -> list[float]:
        """The wrapped scheduler's (unscaled) rates."""
        return list(self._unscaled)

    def get_lr(self) -> list[float]:
        """The rates in use (scaled)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {
            "base_lr_scheduler": self.base_lr_scheduler.state_dict(),
            "base_batch_size": self.base_batch_size,
            "lr_scaling_method": self.lr_scaling_method,
            "batch_sizes": self.batch_sizes,
            "base_lrs": self.base_lrs,
            "last_epoch": self.last_epoch,
            "unscaled_lrs": self._unscaled,
            "verbose": self.verbose,
        }

    def load_state_dict(self, state_dict: Mapping) -> None:
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state_dict[key])
        self._unscaled = list(state_dict["unscaled_lrs"])
        self._scale()


def lr_scheduler_for_variable_batch_size(
    base_batch_size, batch_sizes, dataloader, lr_scheduler_or_optimizer, lr_scaling_method="linear", verbose=False
):
    """A :class:`VariableBatchSizeLR` over an LR scheduler, or over a constant rate when given
    an optimizer."""
    if isinstance(lr_scheduler_or_optimizer, torch.optim.Optimizer):
        scheduler = torch.optim.lr_scheduler.LambdaLR(lr_scheduler_or_optimizer, lambda _: 1.0)
    elif isinstance(getattr(lr_scheduler_or_optimizer, "optimizer", None), torch.optim.Optimizer):
        scheduler = lr_scheduler_or_optimizer
    else:
        raise TypeError(f"expected an LR scheduler or an optimizer, got {type(lr_scheduler_or_optimizer).__name__}")
    return VariableBatchSizeLR(scheduler, base_batch_size, batch_sizes, dataloader, lr_scaling_method, verbose=verbose)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
    dataset,
    dataset_seqlens,
    max_tokens,
    effective_batch_size,
    dataset_filter_ids=None,
    lr_scaling_method="linear",
    min_batch_size=1,
    max_batch_size=None,
    sequence_picking_order="dataloader",
    dataloader_batch_size=1,
    dataloader_rank=0,
    dataloader_num_replicas=1,
    dataloader_num_workers=0,
    dataloader_collate_fn=None,
    dataloader_pin_memory=False,
    lr_scheduler_or_optimizer=None,
    required_microbatches_of_same_size=False,
    required_microbatches_of_same_seqlen=False,
    sample_padding_fn=None,
    verbose=False,
    seed=None,
):
    """``batch_by_seqlens`` + ``dataloader_for_variable_batch_size`` +
    ``lr_scheduler_for_variable_batch_size`` (None when no scheduler or optimizer is given).
    Returns ``(dataloader, lr_scheduler, deepspeed_io_kwargs)``. DeepSpeed's signature."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens,
        max_tokens,
        dataset_filter_ids,
        min_batch_size,
        max_batch_size,
        sequence_picking_order,
        effective_batch_size,
        required_microbatches_of_same_size,
        verbose,
        seed,
    )
    dataloader, io_kwargs = dataloader_for_variable_batch_size(
        dataset,
        microbatch_ids,
        batch_max_seqlens,
        dataloader_rank,
        dataloader_batch_size,
        dataloader_num_replicas,
        dataloader_collate_fn,
        dataloader_num_workers,
        dataloader_pin_memory,
        required_microbatches_of_same_seqlen,
        sample_padding_fn,
    )
    scheduler = None
    if lr_scheduler_or_optimizer is not None:
        scheduler = lr_scheduler_for_variable_batch_size(
            effective_batch_size, batch_sizes, dataloader, lr_scheduler_or_optimizer, lr_scaling_method, verbose
        )
    return dataloader, scheduler, io_kwargs


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset,
    engine,
    dataset_seqlens=None,
    dataset_filter_ids=None,
    dataloader_collate_fn=None,
    sample_padding_fn=None,
    batch_seqlens_fn=None,
):
    """:func:`get_dataloader_and_lr_scheduler_for_variable_batch_size` with the settings of
    ``engine``'s config (``data_efficiency.data_sampling.dynamic_batching``, which must be
    enabled): its global batch, micro-batch, data-parallel rank and size, and its lr
    scheduler (or optimizer). Each sample's length comes from ``dataset_seqlens``, else from
    the analyzer's files under ``dynamic_batching.metrics_path``, which are written first
    with ``batch_seqlens_fn`` (a function of a collated batch giving its samples' lengths)
    when they are missing. DeepSpeed's function and arguments."""
    from shardwise.runtime.data_pipeline.data_sampling.data_analyzer import DistributedDataAnalyzer

    section = engine.config.get("data_efficiency", {})
    sampling = engine.train_config.data_efficiency.data_sampling
    if not sampling.dynamic_batching.enabled:
        raise ValueError(
            "dynamic batching is not enabled: set data_efficiency.data_sampling.dynamic_batching.enabled "
            "to true (with max_tokens) in the config"
        )
    if dataset_seqlens is None:
        metrics_path = sampling.dynamic_batching.metrics_path
        if metrics_path is None:
            raise ValueError("pass dataset_seqlens, or set data_sampling.dynamic_batching.metrics_path")
        index = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric")
        if not (os.path.exists(index + ".bin") and os.path.exists(index + ".idx")):
            if batch_seqlens_fn is None:
                raise ValueError(f"no sequence lengths at {index}.bin/.idx: pass dataset_seqlens or batch_seqlens_fn")
            DistributedDataAnalyzer(
                dataset=dataset,
                metric_functions=[batch_seqlens_fn],
                collate_fn=dataloader_collate_fn,
                batch_size=2**10,
                save_path=metrics_path,
                metric_types=["single_value_per_sample"],
                metric_names=["seqlen"],
                device=engine.device,
                comm_group=engine.comm.group,
            ).run_map_reduce()
        dataset_seqlens = read_seqlens(metrics_path)
        if len(dataset_seqlens) != len(dataset):
            raise ValueError(
                f"{index} holds {len(dataset_seqlens)} lengths for a dataset of {len(dataset)}; delete "
                f"{metrics_path} to measure them again"
            )
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset,
        dataset_seqlens=dataset_seqlens,
        dataset_filter_ids=dataset_filter_ids,
        effective_batch_size=engine.train_batch_size(),
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(),
        dataloader_rank=engine.comm.rank,
        dataloader_num_replicas=engine.comm.world_size,
        dataloader_num_workers=sampling.num_workers,
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=sampling.pin_memory,
        sample_padding_fn=sample_padding_fn,
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=type(engine).__name__ == "PipelineEngine",
        required_microbatches_of_same_seqlen=type(engine).__name__ == "PipelineEngine",
        **dynamic_batching_kwargs(section),
    )


def dynamic_batching_kwargs(data_efficiency_config: Mapping) -> dict:
    """The keyword arguments of ``get_dataloader_and_lr_scheduler_for_variable_batch_size``
    that DeepSpeed's ``data_efficiency`` dict sets (``data_sampling.dynamic_batching`` keys,
    its defaults where absent, ``seed``)."""
    batching = data_efficiency_config["data_sampling"]["dynamic_batching"]
    if "max_tokens" not in batching:
        raise ValueError("data_sampling.dynamic_batching.max_tokens is required")
    return dict(
        max_tokens=batching["max_tokens"],
        lr_scaling_method=batching.get("lr_scaling_method", "linear"),
        min_batch_size=batching.get("min_batch_size", 1),
        max_batch_size=batching.get("max_batch_size"),
        sequence_picking_order=batching.get("sequence_picking_order", "dataloader"),
        verbose=batching.get("verbose", False),
        seed=data_efficiency_config.get("seed", 1234),
    )


def read_seqlens(metrics_path: str) -> np.ndarray:
    """Every sample's length from the analyzer's ``<metrics_path>/seqlen/seqlen_sample_to_metric``
    (the file ``dynamic_batching.metrics_path`` names), as int64."""
    index = MMapIndexedDataset(os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric"))
    return np.concatenate(index[:]).astype(np.int64) if len(index) else np.empty(0, np.int64)
