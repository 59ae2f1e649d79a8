"""The data loader ``initialize(training_data=...)`` and ``engine.deepspeed_io`` return."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


class DistributedLoader:
    """A DataLoader whose DistributedSampler moves to a new epoch on every iteration pass,
    so each pass reshuffles (a plain DataLoader would repeat epoch 0's order forever)."""

    def __init__(self, loader: DataLoader, sampler):
        self.loader, self.sampler = loader, sampler
        self.epoch = 0

    def __iter__(self):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    @property
    def dataset(self):
        return self.loader.dataset


class RepeatingLoader:
    """Iterate ``loader`` forever: when it is exhausted it is restarted (a new epoch for a
    :class:`DistributedLoader`). DeepSpeed's ``RepeatingLoader``, for loops that count
    steps rather than epochs, and for the pipeline engine's data iterators."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def deepspeed_io(
    dataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    pin_memory: bool = False,
    data_sampler=None,
    collate_fn=None,
    num_workers: int = 0,
    drop_last: bool = False,
    seed: int = 0,
) -> DistributedLoader:
    """A loader giving this rank its shard of ``dataset`` in micro-batches of ``batch_size``.

    Args:
        dataset: a map-style ``torch.utils.data.Dataset``.
        batch_size: samples per micro-batch on this rank.
        rank: this rank's data-parallel index.
        world_size: the data-parallel size.
        pin_memory: pin host memory (only useful with a GPU).
        data_sampler: a sampler to use instead of the DistributedSampler.
        collate_fn: forwarded to the DataLoader.
        num_workers: loader worker processes.
        drop_last: drop the last incomplete batch.
        seed: the DistributedSampler's shuffle seed (the same on every rank).
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            "deepspeed_io needs a map-style Dataset (with __len__ and __getitem__); "
            "shard an IterableDataset yourself and build a DataLoader directly"
        )
    sampler = data_sampler or DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        num_workers=num_workers,
        drop_last=drop_last,
    )
    return DistributedLoader(loader, sampler)
