"""Every default of DeepSpeed 0.19.8's config schema that shardwise's config adapter
resolves is DeepSpeed's, except the differences listed (with their reasons) below.

The table was read from DeepSpeed 0.19.8's own config classes (``DeepSpeedConfig`` with only
``train_micro_batch_size_per_gpu`` given, its pydantic sections and their aliases); DeepSpeed
is not imported here. Keys are those of the schema fixture ``deepspeed_schema_keys.json``.
"""

import dataclasses
import enum
import json
from pathlib import Path

import pytest

from shardwise.config import load_config

SCHEMA = json.loads((Path(__file__).parents[1] / "config" / "deepspeed_schema_keys.json").read_text())

DEEPSPEED_0_19_8_DEFAULTS = {
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.profile": False,
    "activation_checkpointing.synchronize_checkpoint_boundary": False,
    "aio.block_size": 1048576,
    "aio.overlap_events": True,
    "aio.queue_depth": 8,
    "aio.single_submit": False,
    "aio.use_gds": False,
    "autotuning.arg_mappings": None,
    "autotuning.enabled": False,
    "autotuning.end_profile_step": 5,
    "autotuning.exps_dir": "autotuning_exps",
    "autotuning.fast": True,
    "autotuning.max_train_batch_size": None,
    "autotuning.metric": "throughput",
    "autotuning.mp_size": 1,
    "autotuning.num_tuning_micro_batch_sizes": 3,
    "autotuning.overwrite": True,
    "autotuning.results_dir": "autotuning_results",
    "autotuning.start_profile_step": 3,
    "autotuning.tuner_early_stopping": 5,
    "autotuning.tuner_num_trials": 50,
    "autotuning.tuner_type": "gridsearch",
    "bf16.check_grad_overflow": True,
    "bf16.enabled": False,
    "bf16.immediate_grad_update": False,
    "checkpoint.load_universal": False,
    "checkpoint.parallel_write.pipeline_stage": False,
    "checkpoint.tag_validation": "WARN",
    "checkpoint.use_node_local_storage": False,
    "comet.api_key": None,
    "comet.enabled": False,
    "comet.experiment_key": None,
    "comet.experiment_name": None,
    "comet.mode": None,
    "comet.online": None,
    "comet.project": None,
    "comet.samples_log_interval": 100,
    "comet.workspace": None,
    "comms_logger.debug": False,
    "comms_logger.enabled": False,
    "comms_logger.prof_all": True,
    "comms_logger.prof_ops": [],
    "comms_logger.verbose": False,
    "communication_data_type": None,
    "csv_monitor.enabled": False,
    "csv_monitor.job_name": "DeepSpeedJobName",
    "csv_monitor.output_path": "",
    "data_efficiency.data_routing.enabled": False,
    "data_efficiency.data_sampling.curriculum_learning.enabled": False,
    "data_efficiency.data_sampling.enabled": False,
    "data_efficiency.data_sampling.num_epochs": 1000,
    "data_efficiency.data_sampling.num_workers": 0,
    "data_efficiency.enabled": False,
    "data_efficiency.seed": 1234,
    "data_types.buffer_dtype": None,
    "data_types.grad_accum_dtype": None,
    "data_types.param_dtype": None,
    "dataloader_drop_last": False,
    "disable_allgather": False,
    "dump_state": False,
    "flops_profiler.detailed": True,
    "flops_profiler.enabled": False,
    "flops_profiler.module_depth": -1,
    "flops_profiler.output_file": None,
    "flops_profiler.profile_step": 1,
    "flops_profiler.recompute_fwd_factor": 0.0,
    "flops_profiler.top_modules": 1,
    "fp16.auto_cast": False,
    "fp16.consecutive_hysteresis": False,
    "fp16.enabled": False,
    "fp16.hysteresis": 2,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale": 0.0,
    "fp16.loss_scale_window": 1000,
    "fp16.min_loss_scale": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "gradient_predivide_factor": 1.0,
    "hybrid_engine.enable_cuda_graph": False,
    "hybrid_engine.enabled": False,
    "hybrid_engine.inference_tp_size": 1,
    "hybrid_engine.max_out_tokens": 512,
    "hybrid_engine.pin_parameters": True,
    "hybrid_engine.release_inference_cache": False,
    "hybrid_engine.tp_gather_partition_size": 8,
    "memory_breakdown": False,
    "prescale_gradients": False,
    "steps_per_print": None,
    "tensorboard.enabled": False,
    "tensorboard.job_name": "DeepSpeedJobName",
    "tensorboard.output_path": "",
    "wall_clock_breakdown": False,
    "wandb.enabled": False,
    "wandb.group": None,
    "wandb.project": "deepspeed",
    "wandb.team": None,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "zero_optimization.allgather_bucket_size": 500000000,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.cpu_offload": None,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.memory_efficient_linear": True,
    "zero_optimization.offload_optimizer.buffer_count": 4,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_optimizer.fast_init": False,
    "zero_optimization.offload_optimizer.nvme_path": None,
    "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_optimizer.ratio": 1.0,
    "zero_optimization.offload_param.buffer_count": 5,
    "zero_optimization.offload_param.buffer_size": 100000000,
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_param.max_in_cpu": 1000000000,
    "zero_optimization.offload_param.nvme_path": None,
    "zero_optimization.offload_param.pin_memory": True,
    "zero_optimization.overlap_comm": False,
    "zero_optimization.reduce_bucket_size": 500000000,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.stage": 0,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.stage3_max_live_parameters": 1000000000,
    "zero_optimization.stage3_max_reuse_distance": 1000000000,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.stage3_param_persistence_threshold": 100000,
    "zero_optimization.stage3_prefetch_bucket_size": 50000000,
    "zero_optimization.sub_group_size": 1000000000,
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_weights": False,
}

KEPT_DIFFERENCES = {
    "zero_optimization.overlap_comm": "DeepSpeed resolves it per stage (False below 3); shardwise always overlaps "
    "the reduction with backward and keeps None (the stage's default)",
    "zero_optimization.offload_optimizer.nvme_path": "0.19.8's code default is None (device nvme then fails on first "
    "use); shardwise keeps DeepSpeed's documented /local_nvme",
    "zero_optimization.offload_param.nvme_path": "as offload_optimizer.nvme_path",
}
"""Keys whose default differs on purpose, with the reason."""


def _leaves(tree, path=()):
    for key, value in tree.items():
        yield ".".join(path + (key,))
        if isinstance(value, dict) and value and (path + (key,))[0] not in ("optimizer", "scheduler"):
            yield from _leaves(value, path + (key,))


_LEGACY_KEYS = {
    "curriculum_learning": ("enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type"),
    "progressive_layer_drop": ("enabled", "theta", "gamma"),
}
REMOVED_IN_0_19_8 = {
    "zero_optimization.mics_shard_size",
    "zero_optimization.mics_hierarchical_params_gather",
    "curriculum_learning.schedule_config",
    *_LEGACY_KEYS,
    *(f"{section}.{key}" for section, keys in _LEGACY_KEYS.items() for key in keys),
    *_leaves({"compression_training": SCHEMA["compression_training"]}),
}
"""Keys 0.19.8 rejects (MiCS, the legacy curriculum, progressive layer drop and the
compression library were removed), so it has no default to compare with; shardwise keeps
the legacy sections with the defaults of the last DeepSpeed that had them
(``tests/unit/data_pipeline``, ``tests/unit/compression``)."""

_SAME_MEANING = {
    "checkpoint.tag_validation": str.lower,  # DeepSpeed stores "WARN", shardwise "Warn": one choice
    "zero_optimization.cpu_offload": bool,  # DeepSpeed's None (deprecated key unset) is "not offloaded"
}
_SECTIONS = {
    "fp16": "fp16",
    "bf16": "bf16",
    "zero_optimization": "zero",
    "aio": "aio",
    "checkpoint": "checkpoint",
    "data_types": "data_types",
    "activation_checkpointing": "activation_checkpointing",
    "hybrid_engine": "hybrid_engine",
    "autotuning": "autotuning",
    "tensorboard": "monitor.tensorboard",
    "wandb": "monitor.wandb",
    "csv_monitor": "monitor.csv_monitor",
    "comet": "monitor.comet",
    "flops_profiler": "monitor.flops_profiler",
    "comms_logger": "monitor.comms_logger",
    "gradient_accumulation_steps": "batch",
    "memory_breakdown": "monitor",
}
_MISSING = object()


def _resolved(config, key: str):
    """Our resolved value for DeepSpeed's ``key`` (``_MISSING``: the adapter keeps none)."""
    parts = key.split(".")
    node = config
    if parts[0] in _SECTIONS:
        for name in _SECTIONS[parts[0]].split("."):
            node = getattr(node, name)
        parts = parts[1:] or parts
    if key == "checkpoint.parallel_write.pipeline_stage":  # None: no parallel write asked for
        return node.parallel_write is not None and node.parallel_write.pipeline_stage
    for name in parts:
        if not dataclasses.is_dataclass(node) or name not in {f.name for f in dataclasses.fields(node)}:
            return _MISSING
        node = getattr(node, name)
    if isinstance(node, enum.Enum):
        node = node.value
    return list(node) if isinstance(node, tuple) else node


@pytest.fixture(scope="module")
def defaults():
    return load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)


def test_the_table_names_keys_of_the_schema():
    assert set(DEEPSPEED_0_19_8_DEFAULTS) <= set(_leaves(SCHEMA))
    assert set(KEPT_DIFFERENCES) <= set(DEEPSPEED_0_19_8_DEFAULTS)


def test_every_key_with_a_resolved_default_is_in_the_table(defaults):
    resolved = {key for key in _leaves(SCHEMA) if _resolved(defaults, key) is not _MISSING}
    sections = {
        "optimizer",
        "scheduler",
        "checkpoint.parallel_write",
        "zero_optimization.offload_optimizer",
        "zero_optimization.offload_param",
        "data_efficiency",
        "data_efficiency.data_sampling",
        "data_efficiency.data_sampling.curriculum_learning",
        "data_efficiency.data_routing",
        "data_efficiency.data_routing.random_ltd",  # kept as given until random-LTD reads it
    }
    assert sorted(resolved - sections - set(DEEPSPEED_0_19_8_DEFAULTS) - REMOVED_IN_0_19_8) == []


@pytest.mark.parametrize("key", sorted(set(DEEPSPEED_0_19_8_DEFAULTS) - set(KEPT_DIFFERENCES)))
def test_default_is_deepspeeds(defaults, key):
    same = _SAME_MEANING.get(key, lambda value: value)
    assert same(_resolved(defaults, key)) == same(DEEPSPEED_0_19_8_DEFAULTS[key])


@pytest.mark.parametrize("key", sorted(KEPT_DIFFERENCES))
def test_kept_differences_still_differ(defaults, key):
    """A kept difference that no longer differs is stale: drop it from the list."""
    assert _resolved(defaults, key) != DEEPSPEED_0_19_8_DEFAULTS[key]
