"""Every key of DeepSpeed's documented config schema loads; see [Note: keys with no effect]."""

import json
import logging
import re
from pathlib import Path

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.config._later import LATER_SCALARS, LATER_SECTIONS
from shardwise.config._no_effect import UNBUILT
from shardwise.config.from_dict import _ZERO_FIELD_NAMES

FIXTURE = Path(__file__).with_name("deepspeed_schema_keys.json")
SCHEMA = json.loads(FIXTURE.read_text())
_WHOLE = {"optimizer", "scheduler"}  # their sub-keys mean nothing without "type"


def _load(**config):
    return load_config({"train_micro_batch_size_per_gpu": 1, **config}, world_size=1)


def _leaves(tree, path=()):
    """Dotted paths of every key in ``tree``, depth first (objects are walked, lists are leaves)."""
    for key, value in tree.items():
        yield path + (key,)
        if isinstance(value, dict) and value and (path + (key,))[0] not in _WHOLE:
            yield from _leaves(value, path + (key,))


def _only(path):
    """The fixture cut down to the one key at ``path`` (inside the parents it sits in)."""
    if path[0] in _WHOLE:
        return {path[0]: SCHEMA[path[0]]}
    node = SCHEMA
    for key in path[:-1]:
        node = node[key]
    config = {path[-1]: node[path[-1]]}
    for key in reversed(path[:-1]):
        config = {key: config}
    return config


def test_the_whole_schema_loads():
    config = load_config(str(FIXTURE), world_size=1)
    assert config.zero.stage == 3 and config.batch.train_batch_size == 8


_TYPED_HOME = {
    "zero_optimization": "zero",
    "memory_breakdown": "monitor.memory_breakdown",
    **{
        name: f"monitor.{name}"
        for name in ("tensorboard", "csv_monitor", "wandb", "comet", "flops_profiler", "comms_logger")
    },
    **{
        name: f"batch.{name}"
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    },
}
"""Where a top-level key lives in the TrainConfig, when not under its own name."""
_OFF_MEANS_UNSET = {
    "zero_optimization.cpu_offload_param": lambda config: config.zero.offload_param.device == "none",
    "checkpoint.parallel_write.pipeline_stage": lambda config: config.checkpoint.parallel_write is None,
}
"""Keys whose off value leaves nothing to hold (the deprecated switch, the disabled writer)."""
_ABSENT = object()


def _typed_value(config, path):
    """What the loaded TrainConfig holds for the key at ``path`` (``_ABSENT``: no field)."""
    node = config
    for attr in _TYPED_HOME.get(path[0], path[0]).split("."):
        node = getattr(node, attr, _ABSENT)
    for key in path[1:]:
        if path[0] == "zero_optimization":
            key = _ZERO_FIELD_NAMES.get(key, key)
        if path[0] == "aio" and key == "thread_count":
            key = "intra_op_parallelism"
        node = node.get(key, _ABSENT) if isinstance(node, dict) else getattr(node, key, _ABSENT)
    return node


def _same(got, want):
    if isinstance(want, list):
        return list(got) == want if isinstance(got, (list, tuple)) else False
    return type(got) is type(want) and got == want if isinstance(want, bool) else got == want


@pytest.mark.parametrize("path", [".".join(p) for p in _leaves(SCHEMA)])
def test_each_key_loads_on_its_own(path, caplog):
    """The key's value reaches the config: the typed field at its place holds it, or the
    key is named as having no effect, or it is an unbuilt feature's key at an off value, or
    it belongs to a section a later feature owns (kept as given)."""
    keys = tuple(path.split("."))
    want = _only(keys)
    for key in keys:
        want = want[key]
    with caplog.at_level(logging.INFO, logger="shardwise"):
        config = _load(**_only(keys))
    no_effect = " ".join(r.getMessage() for r in caplog.records if "no effect" in r.getMessage())
    parent = ".".join(keys[:-1])
    if keys[0] in LATER_SECTIONS or keys[0] in LATER_SCALARS:
        held = config.raw
        for key in keys:
            held = held[key]
        assert held == want
    elif any(re.search(rf"(^|[ :]){re.escape('.'.join(keys[:n]))} \(", no_effect) for n in range(1, len(keys) + 1)):
        pass  # named (itself or its section) in the one no-effect line
    elif keys[-1] in UNBUILT.get(parent, {}):
        assert want in UNBUILT[parent][keys[-1]][1], "an unbuilt feature's key loads only at its off value"
    elif path in _OFF_MEANS_UNSET:
        assert _OFF_MEANS_UNSET[path](config)
    elif keys[0] in _WHOLE:
        held = getattr(config, keys[0])
        assert held.type.lower() == want["type"].lower() and dict(held.params) == want["params"]
    elif isinstance(want, dict):
        assert _typed_value(config, keys) is not _ABSENT, f"section {path} has no place in the config"
    else:
        got = _typed_value(config, keys)
        assert got is not _ABSENT, f"{path} has no field, is not named as having no effect, and is no later section's"
        assert _same(got, want), f"{path}: loaded {got!r}, given {want!r}"


@pytest.mark.parametrize(
    "section,typo,suggestion",
    [
        ("", "zero_optimisation", "zero_optimization"),
        ("fp16", "fp16_master_weight_and_grads", "fp16.fp16_master_weights_and_grads"),
        ("bf16", "check_grad_overflw", "bf16.check_grad_overflow"),
        ("zero_optimization", "round_robin_gradient", "zero_optimization.round_robin_gradients"),
        ("zero_optimization.offload_param", "max_in_cpus", "zero_optimization.offload_param.max_in_cpu"),
        ("zero_optimization.offload_optimizer", "super_offlod", "zero_optimization.offload_optimizer.super_offload"),
        ("zero_optimization.leaf_module", "class", "zero_optimization.leaf_module.classes"),
        ("aio", "queue_dept", "aio.queue_depth"),
        ("checkpoint", "load_universl", "checkpoint.load_universal"),
        ("checkpoint.writer", "io_multiplyer", "checkpoint.writer.io_multiplier"),
        ("checkpoint.parallel_write", "pipeline_stages", "checkpoint.parallel_write.pipeline_stage"),
        ("data_types", "param_dtpye", "data_types.param_dtype"),
        ("comms_logger", "prof_op", "comms_logger.prof_ops"),
        ("flops_profiler", "profile_steps", "flops_profiler.profile_step"),
        ("activation_checkpointing", "number_checkpoint", "activation_checkpointing.number_checkpoints"),
        ("wandb", "projct", "wandb.project"),
        ("comet", "experiment_nam", "comet.experiment_name"),
    ],
)
def test_a_misspelt_key_still_gets_did_you_mean(section, typo, suggestion):
    config = {typo: 1}
    for key in reversed(section.split(".") if section else []):
        config = {key: config}
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        _load(**config)


@pytest.mark.parametrize(
    "config,named",
    [
        ({"zero_optimization": {"stage": 2, "round_robin_gradients": True}}, "zero_optimization.round_robin_gradients"),
        (
            {"zero_optimization": {"stage": 3, "memory_efficient_linear": False}},
            "zero_optimization.memory_efficient_linear",
        ),
        ({"zero_optimization": {"ignore_unused_parameters": False}}, "zero_optimization.ignore_unused_parameters"),
        ({"zero_optimization": {"load_from_fp32_weights": False}}, "zero_optimization.load_from_fp32_weights"),
        (
            {"zero_optimization": {"stage": 3, "max_reuse_distance": 0, "allgather_sequential": True}},
            "zero_optimization.stage3_allgather_sequential",
        ),
        ({"checkpoint": {"writer": {"type": "fast"}}}, "checkpoint.writer"),
        ({"dump_state": True}, "dump_state"),
    ],
)
def test_a_no_effect_key_is_named_in_exactly_one_line(config, named, caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        _load(**config)
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1 and named in lines[0]


def test_several_no_effect_keys_share_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        _load(
            dump_state=True, aio={"single_submit": True}, zero_optimization={"stage": 2, "round_robin_gradients": True}
        )
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(lines) == 1
    assert all(k in lines[0] for k in ("dump_state", "aio.single_submit", "zero_optimization.round_robin_gradients"))


def test_used_and_unbuilt_off_keys_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        _load(
            zero_optimization={
                "stage": 3,
                "zero_hpz_partition_size": 1,
                "zero_quantized_weights": False,
                "prefetch_bucket_size": 10,
            },
            fp16={"enabled": True, "fp16_master_weights_and_grads": False},
        )
    assert not caplog.records


def test_no_effect_keys_are_not_logged_off_rank_0(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        _load(dump_state=True)
    assert not caplog.records


def test_field_names_of_stage3_keys_are_read():
    config = _load(
        zero_optimization={
            "stage": 3,
            "prefetch_bucket_size": 7,
            "param_persistence_threshold": 0,
            "max_live_parameters": 5,
            "max_reuse_distance": 6,
        }
    )
    zero = config.zero
    assert (
        zero.stage3_prefetch_bucket_size,
        zero.stage3_param_persistence_threshold,
        zero.stage3_max_live_parameters,
        zero.stage3_max_reuse_distance,
    ) == (7, 0, 5, 6)
    with pytest.raises(ConfigError, match="both 'zero_optimization.prefetch_bucket_size' and"):
        _load(zero_optimization={"prefetch_bucket_size": 7, "stage3_prefetch_bucket_size": 8})


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads=true asks for fp16 master weights",
        ),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "bf16.bf16_master_weights_and_grads=true asks for bf16 master weights",
        ),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16 optimizer states"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "ZeRO++ hierarchical partitioning"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "ZeRO++ quantized weights"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}, "ZeRO++ quantized gradients"),
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "MiCS"),
        ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
            "SuperOffload",
        ),
        ({"managed_gradient_accumulation": False}, "client-managed accumulation"),
        ({"gradient_allreduce_op": "sum"}, "summed (unaveraged) gradients"),
        ({"datastates_ckpt": {"host_cache_size": 16}}, "DataStates"),
        ({"use_data_before_expert_parallelism": "yes"}, "use_data_before_expert_parallelism must be true or false"),
        ({"graph_harvesting": True}, "graph_harvesting=true"),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 4, "score_func": "sigmoid"}},
            "['score_func'] would change the model's routing",
        ),
        ({"expert_parallel": {"enabled": True, "preset_model": "llama4"}}, "preset_model='llama4' is not one"),
        ({"tensor_parallel": {"autotp_size": 4, "tp": {"tp_grain_size": 64}}}, "uneven splits are not available"),
        ({"compile": {"deepcompile": True}}, "DeepCompile"),
        ({"weight_quantization": {"post_init_quant": {}}}, "weight quantization"),
        ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype='bf16' differs"),
        ({"data_types": {"buffer_dtype": "fp32"}}, "data_types.buffer_dtype='fp32' (casting module buffers)"),
    ],
)
def test_a_newly_accepted_key_that_turns_on_an_unbuilt_feature_is_refused(config, message):
    with pytest.raises(ConfigError) as info:
        _load(**config)
    assert message in str(info.value)


def test_unbuilt_keys_of_a_disabled_precision_section_ask_for_nothing():
    config = _load(
        fp16={"enabled": False, "fp16_master_weights_and_grads": True},
        bf16={"bf16_master_weights_and_grads": True, "check_grad_overflow": True},
    )
    assert not config.fp16.enabled and not config.bf16.enabled


def test_deprecated_cpu_offload_param_maps_to_offload_param():
    with pytest.warns(DeprecationWarning, match="cpu_offload_param"):
        config = _load(zero_optimization={"stage": 3, "cpu_offload_param": True})
    assert config.zero.offload_param.device == "cpu"


def test_disabled_parallel_write_and_null_nvme_path_are_accepted():
    config = _load(
        checkpoint={"parallel_write": {"pipeline_stage": False}},
        zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "nvme_path": None}},
    )
    assert config.checkpoint.parallel_write is None and config.zero.offload_param.device == "cpu"
