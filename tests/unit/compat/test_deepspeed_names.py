"""DeepSpeed's public module names exist in shardwise (``deepspeed.X`` -> ``shardwise.X``).

The list is DeepSpeed's surface that training scripts and Hugging Face's integrations
import; add a name here when shardwise adds it. Names of features not built yet are
importable and raise NotImplementedError when called, never at import.
"""

import importlib

import pytest

NAMES = {
    "": [
        "initialize",
        "add_config_arguments",
        "init_distributed",
        "DeepSpeedEngine",
        "DeepSpeedConfig",
        "__version__",
        "zero",
        "ops",
        "comm",
        "utils",
        "checkpointing",
        "moe",
        "tp_model_init",
        "init_inference",
        "InferenceEngine",
        "get_accelerator",
        "OnDevice",
        "DeepSpeedTransformerLayer",
        "DeepSpeedTransformerConfig",
        "PipelineModule",
        "PipelineEngine",
        "log_dist",
        "logger",
        "module_inject",
        "pipe",
        "DeepSpeedConfigError",
    ],
    "inference.config": ["DeepSpeedInferenceConfig"],
    "inference.engine": ["InferenceEngine"],
    "zero": ["Init", "GatheredParameters", "register_external_parameter"],
    "comm": [
        "init_distributed",
        "get_rank",
        "get_world_size",
        "get_local_rank",
        "barrier",
        "all_reduce",
        "all_gather",
        "broadcast",
        "is_initialized",
        "ReduceOp",
        "reduce_scatter",
        "all_gather_into_tensor",
        "new_group",
        "get_global_rank",
        "configure",
        "log_summary",
        "reset_log",
        "has_comm_data",
        "get_comm_operation_count",
        "get_logged_comm_ops",
    ],
    "monitor.monitor": ["Monitor", "MonitorMaster"],
    "monitor.tensorboard": ["TensorBoardMonitor"],
    "monitor.csv_monitor": ["csvMonitor"],
    "monitor.wandb": ["WandbMonitor"],
    "monitor.comet": ["CometMonitor"],
    "accelerator": ["get_accelerator"],
    "utils": [
        "RepeatingLoader",
        "logger",
        "log_dist",
        "groups",
        "safe_get_full_fp32_param",
        "safe_get_full_grad",
        "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param",
        "safe_set_full_optimizer_state",
        "safe_get_local_fp32_param",
        "set_z3_leaf_modules",
        "is_initialized",
        "OnDevice",
        "recursive_getattr",
        "recursive_setattr",
    ],
    "utils.logging": ["logger", "log_dist", "log_dist_once", "print_dist", "set_log_level_from_string"],
    "utils.module_utils": ["recursive_getattr", "recursive_setattr"],
    "utils.init_on_device": ["OnDevice"],
    "compression.helper": ["recursive_getattr", "recursive_setattr"],
    "module_inject": [
        "replace_policy",
        "HFGPT2LayerPolicy",
        "HFOPTLayerPolicy",
        "GPTNEOXLayerPolicy",
        "LLAMALayerPolicy",
        "LLAMA2LayerPolicy",
    ],
    "module_inject.replace_policy": [
        "HFGPT2LayerPolicy",
        "HFOPTLayerPolicy",
        "GPTNEOXLayerPolicy",
        "LLAMALayerPolicy",
        "LLAMA2LayerPolicy",
        "replace_policies",
    ],
    "ops.transformer": ["DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"],
    "ops.transformer.transformer": ["DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"],
    "utils.zero_to_fp32": [
        "get_fp32_state_dict_from_zero_checkpoint",
        "load_state_dict_from_zero_checkpoint",
        "convert_zero_checkpoint_to_fp32_state_dict",
    ],
    "utils.groups": [
        "get_data_parallel_world_size",
        "get_data_parallel_rank",
        "get_model_parallel_world_size",
        "_get_sequence_parallel_world_size",
    ],
    "runtime.utils": ["set_random_seed", "see_memory_usage", "move_to_device"],
    "runtime.zero": ["GatheredParameters", "Init"],
    "runtime.zero.offload_config": ["OffloadDeviceEnum", "OffloadStateTypeEnum"],
    "runtime.zero.partition_parameters": [
        "ZeroParamStatus",
        "Init",
        "GatheredParameters",
        "zero_wrapper_for_fp_tensor_constructor",
        "_orig_torch_arange",
    ],
    "runtime.zero.config": ["DeepSpeedZeroConfig", "ZeroStageEnum"],
    "runtime.engine": ["DeepSpeedEngine"],
    "runtime.config": [
        "DeepSpeedConfig",
        "DeepSpeedConfigError",
        "ADAGRAD_OPTIMIZER",
        "ADAM_OPTIMIZER",
        "ADAMW_OPTIMIZER",
        "LAMB_OPTIMIZER",
        "LION_OPTIMIZER",
    ],
    "runtime.lr_schedules": [
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
        "OneCycle",
        "LRRangeTest",
        "VALID_LR_SCHEDULES",
    ],
    "runtime.dataloader": ["RepeatingLoader", "DeepSpeedDataLoader"],
    "runtime.activation_checkpointing.checkpointing": [
        "checkpoint",
        "configure",
        "get_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed",
    ],
    "checkpointing": ["checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker"],
    "checkpoint.utils": ["clone_tensors_for_torch_save"],
    "pipe": [
        "ProcessTopology",
        "PipeDataParallelTopology",
        "PipeModelDataParallelTopology",
        "PipelineModule",
        "LayerSpec",
        "TiedLayerSpec",
    ],
    "runtime.pipe.module": ["PipelineModule", "LayerSpec", "TiedLayerSpec"],
    "runtime.pipe.engine": ["PipelineEngine"],
    "runtime.pipe.topology": [
        "ProcessTopology",
        "PipeDataParallelTopology",
        "PipeModelDataParallelTopology",
        "PipelineParallelGrid",
    ],
    "moe.utils": ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"],
    "moe.layer": ["MoE"],
    "ops.adam": ["DeepSpeedCPUAdam", "FusedAdam"],
    "ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "ops.lion": ["DeepSpeedCPULion", "FusedLion"],
    "ops.sparse_attention": [
        "SparsityConfig",
        "DenseSparsityConfig",
        "FixedSparsityConfig",
        "VariableSparsityConfig",
        "BigBirdSparsityConfig",
        "BSLongformerSparsityConfig",
        "LocalSlidingWindowSparsityConfig",
        "SparseSelfAttention",
        "BertSparseSelfAttention",
        "SparseAttentionUtils",
    ],
    "ops.sparse_attention.sparsity_config": ["FixedSparsityConfig", "BSLongformerSparsityConfig"],
    "ops.sparse_attention.sparse_self_attention": ["SparseSelfAttention"],
    "ops.sparse_attention.bert_sparse_self_attention": ["BertSparseSelfAttention"],
    "ops.sparse_attention.sparse_attention_utils": ["SparseAttentionUtils"],
    "launcher.runner": ["DEEPSPEED_ENVIRONMENT_NAME"],
    "runtime.fp16.onebit.adam": ["OnebitAdam"],
    "runtime.fp16.onebit.zoadam": ["ZeroOneAdam"],
    "runtime.fp16.onebit.lamb": ["OnebitLamb"],
    "version": ["__version__"],
    "profiling.flops_profiler": [
        "FlopsProfiler",
        "get_model_profile",
        "number_to_string",
        "macs_to_string",
        "flops_to_string",
        "params_to_string",
        "duration_to_string",
        "bytes_to_string",
    ],
    "profiling.flops_profiler.profiler": ["FlopsProfiler", "get_model_profile"],
}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_deepspeed_module_names_exist(module):
    loaded = importlib.import_module("shardwise" + ("." + module if module else ""))
    missing = [name for name in NAMES[module] if not hasattr(loaded, name)]
    assert not missing, f"shardwise.{module} lacks {missing}"


def test_unbuilt_features_raise_when_called_not_at_import():
    import torch

    import shardwise
    from shardwise.moe.layer import MoE

    with pytest.raises(NotImplementedError, match="mixture of experts"):
        MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2)
    model = torch.nn.Linear(2, 2)  # tp_model_init records the size; initialize() splits the model
    assert shardwise.tp_model_init(model, tp_size=2, dtype=torch.float32) is model
    with pytest.raises(NotImplementedError, match="tp_group"):
        shardwise.tp_model_init(model, tp_size=2, dtype=torch.float32, tp_group=object())
