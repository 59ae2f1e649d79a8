"""Curriculum data sampling switched on by the config (``data_efficiency.data_sampling.
curriculum_learning``) on 2 ranks: ``initialize(training_data=...)`` gives a loader whose
micro-batches are the ``DeepSpeedDataSampler``'s (the same indices as a sampler built by
hand), every sample in them is within the scheduled difficulty (``set_data_post_process_func``
sees the sampler's state), and a run resumed from an engine checkpoint draws exactly the
batches of the uninterrupted run."""

import importlib.util
import os

import torch
from torch import nn

import shardwise
from shardwise.runtime.data import CurriculumLoader
from shardwise.runtime.data_pipeline.data_sampling import DeepSpeedDataSampler
from shardwise.testing import run_distributed

_UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "unit", "data_pipeline")
_spec = importlib.util.spec_from_file_location("_sampler_reference", os.path.join(_UNIT, "make_deepspeed_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)
MICRO, GAS, STEPS, SAVE_AT = 2, 2, 6, 3


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = ref.analyzer_dataset()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(ref.VOCAB, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, rows):
        return self.out(self.embed(rows)).pow(2).mean()


def _data_efficiency(clusters):
    return ref.sampler_configs(os.path.join(_UNIT, "deepspeed_reference", "analyzer"), clusters)["value"]


def _engine(clusters):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
        "data_efficiency": _data_efficiency(clusters),
    }
    engine, _, loader, _ = shardwise.initialize(model=Model(), config=config, training_data=Rows())
    engine.set_data_post_process_func(lambda batch, state: (batch, dict(state["current_difficulties"])))
    return engine, iter(loader)


def _train(engine, batches, steps, out):
    for _ in range(steps * GAS):
        rows, difficulty = next(batches)
        out.append((rows.tolist(), difficulty["seqlen"]))
        engine.backward(engine(rows))
        engine.step()


def _job(rank, world_size, root):
    engine, batches = _engine(os.path.join(root, "whole"))
    assert isinstance(engine.training_dataloader, CurriculumLoader)
    whole = []
    _train(engine, batches, STEPS, whole)
    by_hand = DeepSpeedDataSampler(
        _data_efficiency(os.path.join(root, "by_hand")),
        len(Rows()),
        MICRO,
        rank,
        world_size,
        torch.distributed.group.WORLD,
        GAS,
        rank,
    )
    hand = iter(by_hand)
    expected = [Rows().rows[next(hand)].tolist() for _ in range(STEPS * GAS)]

    first, batches = _engine(os.path.join(root, "resumed"))
    part = []
    _train(first, batches, SAVE_AT, part)
    first.save_checkpoint(os.path.join(root, "ckpt"), tag="mid")
    resumed, batches = _engine(os.path.join(root, "resumed"))
    resumed.load_checkpoint(os.path.join(root, "ckpt"), tag="mid")
    _train(resumed, batches, STEPS - SAVE_AT, part)
    return whole, expected, part


def test_the_sampler_feeds_training_and_resumes_exactly(tmp_path):
    results = run_distributed(_job, world_size=2, tmp_path=tmp_path, root=str(tmp_path))
    (whole0, _, _), (whole1, _, _) = results
    for (rows0, _), (rows1, _) in zip(whole0, whole1):
        assert rows0 != rows1, "each rank takes its own slice of the global batch"
    for whole, expected, part in results:
        assert [rows for rows, _ in whole] == expected
        difficulties = [d for _, d in whole]
        assert difficulties == sorted(difficulties)
        for rows, difficulty in whole:
            assert all(sum(t != 0 for t in row) <= difficulty for row in rows), (rows, difficulty)
        assert part == whole, "the resumed run draws the uninterrupted run's batches"


def _dynamic_job(rank, world_size):
    from shardwise.runtime.data_pipeline.data_sampling import (
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    )

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "data_efficiency": {
            "enabled": True,
            "seed": 3,
            "data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 12, "lr_scaling_method": "linear"}},
        },
    }
    engine, *_ = shardwise.initialize(model=Model(), config=config)
    rows = Rows()
    seqlens = (rows.rows != 0).sum(dim=1).numpy()
    loader, lr_scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        rows, engine, dataset_seqlens=seqlens
    )
    batches = [[int((row != 0).sum()) for row in batch] for batch in loader]
    return batches, type(lr_scheduler).__name__


def test_dynamic_batching_builds_token_budget_batches_from_the_engine_config(tmp_path):
    results = run_distributed(_dynamic_job, world_size=2, tmp_path=tmp_path)
    (batches0, scheduler), (batches1, _) = results
    assert scheduler == "VariableBatchSizeLR"
    assert batches0 and len(batches0) == len(batches1), "the micro-batches are dealt to the ranks in turn"
    for batch in batches0 + batches1:
        assert sum(batch) <= 12 and len(batch) >= 1, batch
    assert len({len(b) for b in batches0 + batches1}) > 1, "the batch size follows the lengths"
