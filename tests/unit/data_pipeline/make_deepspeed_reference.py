"""Write the reference index files the data-sampling tests compare against, with DeepSpeed.

Run with a Python that has DeepSpeed 0.19.8 (not a shardwise dependency), from the repo root:

    /work/ds-env/bin/python tests/unit/data_pipeline/make_deepspeed_reference.py

It rewrites ``tests/unit/data_pipeline/deepspeed_reference/``:
- ``rows``: an index of uint16 rows (one empty) in two documents, from DeepSpeed's builder;
- ``analyzer/``: DeepSpeed's DataAnalyzer output for ``analyzer_dataset()`` (map on two
  workers, then reduce), without the per-worker map files; ``analyzer_map/``: the map
  files alone (before the reduce), which the tests reduce here;
- ``sampler_batches.json``: the first micro-batches DeepSpeed's DeepSpeedDataSampler yields
  over that index for each config of ``sampler_configs()`` (one rank, gloo);
- ``dynamic_batching.json``: DeepSpeed's ``batch_by_seqlens`` for each of ``BATCHING_CASES``
  over the dataset's lengths, and the learning rates its VariableBatchSizeLR sets.
The dataset and metric functions are defined here and imported by the tests, so both
libraries analyze the same thing.
"""

import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "deepspeed_reference")
NUM_SAMPLES = 200
ROW_LEN = 6
VOCAB = 8
ANALYZER_KWARGS = dict(
    batch_size=4,
    metric_names=["seqlen", "vocab"],
    metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
    metric_dtypes=[torch.int64, torch.int64],
)
ROWS = [[1, 2, 3], [], [65535, 0], [7] * 5, [4]]


def analyzer_dataset() -> torch.Tensor:
    """NUM_SAMPLES rows of ROW_LEN token ids; trailing zeros are padding, lengths 1..ROW_LEN."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (NUM_SAMPLES, ROW_LEN), generator=gen)
    lengths = torch.randint(1, ROW_LEN + 1, (NUM_SAMPLES,), generator=gen)
    return tokens * (torch.arange(ROW_LEN)[None, :] < lengths[:, None])


def seqlen_metric(batch: torch.Tensor) -> torch.Tensor:
    return (batch != 0).sum(dim=1)


def vocab_metric(batch: torch.Tensor) -> torch.Tensor:
    return torch.bincount(batch.flatten(), minlength=VOCAB)


def _write_rows(prefix: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.utils import (
        close_mmap_dataset_builder,
        create_mmap_dataset_builder,
    )

    builder = create_mmap_dataset_builder(prefix, np.uint16)
    for i, row in enumerate(ROWS):
        builder.add_item_numpy(np.array(row, dtype=np.uint16))
        if i == 2:
            builder.end_document()
    close_mmap_dataset_builder(builder, prefix)


def _run_analyzer(save_path: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    kwargs = dict(ANALYZER_KWARGS, metric_functions=[seqlen_metric, vocab_metric], save_path=save_path)
    for worker_id in range(2):
        DataAnalyzer(analyzer_dataset(), num_workers=2, worker_id=worker_id, **kwargs).run_map()
    shutil.copytree(save_path, os.path.join(OUT, "analyzer_map"))
    DataAnalyzer(analyzer_dataset(), num_workers=2, worker_id=0, **kwargs).run_reduce()
    for metric in kwargs["metric_names"]:
        for name in os.listdir(os.path.join(save_path, metric)):
            if name.startswith("worker") or "_thread" in name:
                path = os.path.join(save_path, metric, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def sampler_configs(index_root: str, cluster_root: str) -> dict:
    """data_efficiency dicts: value-based linear, percentile-based discrete, and both at once."""
    prefix = os.path.join(index_root, "seqlen", "seqlen")
    by_value = {
        "index_to_sample_path": f"{prefix}_index_to_sample",
        "index_to_metric_path": f"{prefix}_index_to_metric",
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 1,
        "max_difficulty": 6,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 50, "difficulty_step": 1},
    }
    by_percentile = {
        "index_to_sample_path": f"{prefix}_index_to_sample_percentile_merged",
        "index_to_metric_path": f"{prefix}_index_to_metric",
        "difficulty_type": "percentile",
        "clustering_type": "schedule_based",
        "min_difficulty": 10,
        "max_difficulty": 100,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [10, 70, 100], "max_step": [10, 20]},
    }
    cases = {
        "value": {"seqlen": by_value},
        "percentile": {"pct": by_percentile},
        "both": {"seqlen": by_value, "pct": by_percentile},
    }
    return {
        name: {
            "enabled": True,
            "seed": 7,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 2,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": os.path.join(cluster_root, name),
                    "curriculum_metrics": metrics,
                },
            },
        }
        for name, metrics in cases.items()
    }


SAMPLER_MICRO, SAMPLER_GAS, SAMPLER_ROWS = 2, 2, 48


def _run_sampler() -> dict:
    import json
    import tempfile

    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    with tempfile.TemporaryDirectory() as clusters:
        for name, config in sampler_configs(os.path.join(OUT, "analyzer"), clusters).items():
            sampler = DeepSpeedDataSampler(config, NUM_SAMPLES, SAMPLER_MICRO, 0, 1, dist.group.WORLD, SAMPLER_GAS, 0)
            rows = iter(sampler)
            out[name] = [[int(i) for i in next(rows)] for _ in range(SAMPLER_ROWS)]
    with open(os.path.join(OUT, "sampler_batches.json"), "w") as f:
        json.dump(out, f)


BATCHING_CASES = {
    "dataloader": dict(max_tokens=10, effective_batch_size=2),
    "seqlen_same_size": dict(
        max_tokens=12,
        min_batch_size=2,
        max_batch_size=4,
        sequence_picking_order="seqlen",
        effective_batch_size=2,
        required_microbatches_of_same_size=True,
    ),
}
LR_STEPS = 6


def lr_schedulers(optimizer_factory):
    """The wrapped schedules the LR reference covers: a constant rate and a halving LambdaLR."""
    return {
        "constant": optimizer_factory(),
        "halving": torch.optim.lr_scheduler.LambdaLR(optimizer_factory(), lambda step: 0.5**step),
    }


def lr_optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _run_batching() -> None:
    import json

    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        batch_by_seqlens,
        lr_scheduler_for_variable_batch_size,
    )

    seqlens = seqlen_metric(analyzer_dataset()).tolist()
    out = {"batches": {}, "lrs": {}}
    for name, case in BATCHING_CASES.items():
        ids, sizes, longest = batch_by_seqlens(seqlens, **case)
        out["batches"][name] = [[[b, list(map(int, m))] for b, m in ids], sizes, longest]
    sizes = out["batches"]["dataloader"][1]
    for name, base in lr_schedulers(lr_optimizer).items():
        scheduler = lr_scheduler_for_variable_batch_size(4, sizes, None, base, lr_scaling_method="sqrt")
        lrs = [scheduler.get_lr()[0]]
        for _ in range(LR_STEPS):
            scheduler.step()
            lrs.append(scheduler.get_lr()[0])
        out["lrs"][name] = lrs
    with open(os.path.join(OUT, "dynamic_batching.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    _write_rows(os.path.join(OUT, "rows"))
    _run_analyzer(os.path.join(OUT, "analyzer"))
    _run_sampler()
    _run_batching()
