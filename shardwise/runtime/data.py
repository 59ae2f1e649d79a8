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

    @property
    def data_sampler(self):
        """The sampler (DeepSpeed's name)."""
        return self.sampler


class CurriculumLoader:
    """DeepSpeed's loader under curriculum data sampling: ``data_sampler`` (a
    ``DeepSpeedDataSampler``) hands this rank the sample indices of each micro-batch, and
    ``post_process_func(batch, data_sampler.state_dict())`` (``engine.set_data_post_process_func``)
    is applied to every batch."""

    def __init__(self, dataset, data_sampler, *, collate_fn=None, pin_memory=False, num_workers=0):
        self.data_sampler = data_sampler
        self.post_process_func = None
        self.loader = DataLoader(
            dataset, batch_sampler=data_sampler, collate_fn=collate_fn, pin_memory=pin_memory, num_workers=num_workers
        )
        self._batches = None

    def __iter__(self):
        self._batches = iter(self.loader)
        return self

    def __next__(self):
        if self._batches is None:
            iter(self)
        batch = next(self._batches)
        if self.post_process_func is not None:
            batch = self.post_process_func(batch, self.data_sampler.state_dict())
        return batch

    def __len__(self) -> int:
        """Micro-batches over all planned epochs (DeepSpeed's length)."""
        return len(self.data_sampler) // self.data_sampler.micro_batch_size

    @property
    def dataset(self):
        return self.loader.dataset


class _SamplerState:
    """The curriculum sampler's position as a training feature of the engine, so that
    checkpoints save it and a resume continues the sampling exactly (DeepSpeed's
    ``data_sampler`` checkpoint entry); it passes nothing to the forward."""

    name = "data_sampler"
    keyword_help: dict = {}

    def __init__(self, sampler):
        self.sampler = sampler

    def forward_kwargs(self, global_steps: int) -> dict:
        return {}

    def before_model_step(self, global_steps: int) -> None:
        pass

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        del global_steps, clip_coef  # nothing moves after the optimizer step

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def engine_loader(engine, dataset, *, batch_size: int, pin_memory: bool, data_sampler, collate_fn, num_workers):
    """The loader ``engine.deepspeed_io`` returns: with ``data_efficiency.data_sampling.
    curriculum_learning`` enabled and no sampler given, a :class:`CurriculumLoader` over a
    ``DeepSpeedDataSampler`` whose state the engine's checkpoints keep (as DeepSpeed's
    engine does); otherwise :func:`deepspeed_io`'s shard of ``dataset``."""
    sampling = engine.train_config.data_efficiency.data_sampling
    if not sampling.curriculum_learning.enabled or data_sampler is not None:
        return deepspeed_io(
            dataset,
            batch_size=batch_size,
            rank=engine.comm.rank,
            world_size=engine.comm.world_size,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            drop_last=engine.train_config.dataloader_drop_last,
        )
    from shardwise.runtime.data_pipeline.data_sampling import DeepSpeedDataSampler

    sampler = DeepSpeedDataSampler(
        engine.config["data_efficiency"],
        len(dataset),
        batch_size,
        engine.comm.rank,
        engine.comm.world_size,
        engine.comm.group,
        engine.gradient_accumulation_steps(),
        engine.global_rank,
        drop_last=engine.train_config.dataloader_drop_last,
    )
    engine.training_features.add(_SamplerState(sampler))
    workers = num_workers or sampling.num_workers
    return CurriculumLoader(dataset, sampler, collate_fn=collate_fn, pin_memory=pin_memory, num_workers=workers)


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
