"""What the demo (``train_gpt.py``) needs for the ``data_efficiency`` section's data sampling.

- Curriculum data sampling (``data_sampling.curriculum_learning``): the sampler reads index
  files that rank the samples by a difficulty metric. The demo knows one metric, ``rarity``
  (DeepSpeed's tutorial's vocabulary rarity: a block's mean ``-log p(byte)`` under the corpus'
  byte frequencies, x1000 as an integer), and writes its index files with
  ``DistributedDataAnalyzer`` on first use, where the config's ``index_to_sample_path`` points.
- Dynamic batching (``data_sampling.dynamic_batching``): token-budget batches need samples
  of different lengths, which fixed blocks are not; the demo then trains on "paragraphs" of
  code (the corpus cut at blank lines, at most ``seq_len`` bytes each), padded per batch.
"""

from __future__ import annotations

import os

import torch

from shardwise.runtime.data_pipeline.data_sampling import DistributedDataAnalyzer, MMapIndexedDataset

RARITY = "rarity"
PAD_TARGET = -100
"""Targets of padding positions: ``F.cross_entropy`` ignores them."""


def rarity_metric(corpus: torch.Tensor):
    """The ``rarity`` metric function over collated ``(x, y)`` batches of ``corpus``."""
    counts = torch.bincount(corpus.long(), minlength=256).double() + 1
    surprise = -(counts / counts.sum()).log()

    def metric(batch):
        x, _ = batch
        return (surprise[x].mean(dim=1) * 1000).round().long()

    return metric


def prepare_curriculum_index(section: dict, dataset, corpus: torch.Tensor) -> None:
    """Write the ``rarity`` index files the config's curriculum names, if missing (every rank
    calls this after the process group exists); refuse other metrics and stale files."""
    metrics = section["data_sampling"]["curriculum_learning"]["curriculum_metrics"]
    for name, metric in metrics.items():
        if name != RARITY:
            raise SystemExit(
                f"the demo computes the curriculum metric '{RARITY}' only, not '{name}': rename the "
                f"metric in data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
            )
        index = metric["index_to_sample_path"]
        folder = os.path.dirname(os.path.dirname(index))  # <folder>/rarity/rarity_index_to_...
        if not os.path.exists(index + ".idx"):
            DistributedDataAnalyzer(
                dataset,
                batch_size=256,
                metric_names=[RARITY],
                metric_functions=[rarity_metric(corpus)],
                metric_types=["single_value_per_sample"],
                save_path=folder,
                device="cpu",
                comm_group=torch.distributed.group.WORLD,
            ).run_map_reduce()
        counted = len(MMapIndexedDataset(os.path.join(folder, RARITY, f"{RARITY}_sample_to_metric")))
        if counted != len(dataset):
            raise SystemExit(
                f"{folder} indexes {counted} samples but this corpus has {len(dataset)} (another "
                f"--corpus_bytes or --seq_len): delete {folder} and the config's data_cluster_path, "
                "and the demo writes them again"
            )


class CodeParagraphs(torch.utils.data.Dataset):
    """``corpus`` cut after each blank line into pieces of 8 to ``seq_len + 1`` bytes (longer
    paragraphs in several); item ``i`` is ``(x, y)`` of its length minus one."""

    def __init__(self, corpus: torch.Tensor, *, seq_len: int):
        self.corpus = corpus
        breaks = ((corpus[:-1] == 10) & (corpus[1:] == 10)).nonzero().flatten() + 2
        bounds = [0, *breaks.tolist(), corpus.numel()]
        self.pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            for first in range(start, end, seq_len + 1):
                if min(end, first + seq_len + 1) - first >= 8:
                    self.pieces.append((first, min(end, first + seq_len + 1)))

    def __len__(self) -> int:
        return len(self.pieces)

    def seqlens(self) -> list[int]:
        return [end - start - 1 for start, end in self.pieces]

    def __getitem__(self, index: int):
        start, end = self.pieces[index]
        window = self.corpus[start:end].long()
        return window[:-1], window[1:]


def pad_collate(samples):
    """Stack ``(x, y)`` samples padded to the longest: ``x`` with 0, ``y`` with ``PAD_TARGET``."""
    longest = max(x.numel() for x, _ in samples)
    xs = torch.zeros(len(samples), longest, dtype=torch.long)
    ys = torch.full((len(samples), longest), PAD_TARGET, dtype=torch.long)
    for i, (x, y) in enumerate(samples):
        xs[i, : x.numel()], ys[i, : y.numel()] = x, y
    return xs, ys
