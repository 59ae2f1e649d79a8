"""Curriculum data sampling: index files, the analyzer that builds them, the sampler that
reads them, and token-budget (dynamic) batching.

DeepSpeed's module paths are kept (``data_sampling.indexed_dataset``, ``.data_analyzer``,
``.data_sampler``, ``.utils``, ``.variable_batch_size_and_lr``) so scripts written for
``deepspeed.runtime.data_pipeline.data_sampling`` import the same names from here, and the
index files each library writes load in the other.
"""

from shardwise.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer, DistributedDataAnalyzer
from shardwise.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from shardwise.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)
from shardwise.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
)
from shardwise.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dynamic_batching_kwargs,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    lr_scheduler_for_variable_batch_size,
    read_seqlens,
    scale_lr,
)

__all__ = [
    "DataAnalyzer",
    "DeepSpeedDataSampler",
    "DistributedDataAnalyzer",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "VariableBatchSizeLR",
    "batch_by_seqlens",
    "close_mmap_dataset_builder",
    "create_mmap_dataset_builder",
    "dynamic_batching_kwargs",
    "find_fit_int_dtype",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    "lr_scheduler_for_variable_batch_size",
    "read_seqlens",
    "scale_lr",
]
