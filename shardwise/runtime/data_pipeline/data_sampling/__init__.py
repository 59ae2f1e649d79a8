"""Curriculum data sampling: index files, the analyzer that builds them, the sampler that
reads them, and token-budget (dynamic) batching.

DeepSpeed's module paths are kept (``data_sampling.indexed_dataset``, ``.data_analyzer``,
``.data_sampler``, ``.utils``, ``.variable_batch_size_and_lr``) so scripts written for
``deepspeed.runtime.data_pipeline.data_sampling`` import the same names from here, and the
index files each library writes load in the other.
"""
