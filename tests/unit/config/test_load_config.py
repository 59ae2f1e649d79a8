import json
import warnings

import pytest

from shardwise.config import ConfigError, TrainConfig, load_config


def _load(world_size=1, **config):
    return load_config(config, world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(
    "left_out", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", None]
)
def test_any_two_batch_sizes_give_the_third(world_size, left_out):
    full = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 16 // world_size,
    }
    given = {k: v for k, v in full.items() if k != left_out}
    batch = _load(world_size, **given).batch
    assert (batch.train_batch_size, batch.train_micro_batch_size_per_gpu, batch.gradient_accumulation_steps) == tuple(
        full.values()
    )


def test_only_train_batch_size():
    batch = _load(4, train_batch_size=32).batch
    assert (batch.train_micro_batch_size_per_gpu, batch.gradient_accumulation_steps) == (8, 1)


def test_only_micro_batch():
    batch = _load(2, train_micro_batch_size_per_gpu=3).batch
    assert (batch.train_batch_size, batch.gradient_accumulation_steps) == (6, 1)


def test_auto_batch_values_are_derived():
    batch = _load(
        2, train_batch_size="auto", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps="auto"
    ).batch
    assert batch.train_batch_size == 8


def test_inconsistent_batch_sizes_print_all_three_numbers():
    with pytest.raises(ConfigError) as info:
        _load(2, train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    message = str(info.value)
    for part in (
        "train_batch_size (32)",
        "train_micro_batch_size_per_gpu (4)",
        "gradient_accumulation_steps (2)",
        "world size (2)",
        "= 16",
    ):
        assert part in message


def test_no_batch_size_at_all():
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        _load(1)


def test_indivisible_batch():
    with pytest.raises(ConfigError, match=r"train_batch_size \(10\) is not divisible .* \(4\)"):
        _load(4, train_batch_size=10)


def test_unknown_top_level_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="unknown config key 'zero_optimisation'; did you mean 'zero_optimization'?"):
        _load(train_micro_batch_size_per_gpu=1, zero_optimisation={"stage": 0})


def test_unknown_nested_key_names_the_path():
    with pytest.raises(
        ConfigError, match="unknown config key 'fp16.loss_scale_windw'; did you mean 'fp16.loss_scale_window'?"
    ):
        _load(train_micro_batch_size_per_gpu=1, fp16={"loss_scale_windw": 10})


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(
        ConfigError,
        match="valid keys in 'bf16' are: bf16_master_weights_and_grads, "
        "bf16_optimizer_states, check_grad_overflow, enabled, immediate_grad_update",
    ):
        _load(train_micro_batch_size_per_gpu=1, bf16={"xyz": 1})


@pytest.mark.parametrize(
    "config,message",
    [
        ({"fp16": {"loss_scale_window": -3}}, "fp16.loss_scale_window must be a positive integer, got -3"),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled must be true or false, got 'yes'"),
        ({"gradient_clipping": -1}, "gradient_clipping must be >= 0, got -1"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be an integer from 0 to 3, got 4"),
        ({"steps_per_print": 0}, "steps_per_print must be a positive integer, got 0"),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
            "optimizer.params.betas must be two numbers in [0, 1), got [0.9]",
        ),
        (
            {"optimizer": {"type": "Adamm"}},
            "optimizer.type must be one of adam, adamw, sgd, adagrad, lamb, lion, "
            "onebitadam, zerooneadam, onebitlamb, got 'Adamm'; did you mean 'adam'?",
        ),
        (
            {"scheduler": {"type": "WarmupLr"}},
            "scheduler.type must be one of WarmupLR, WarmupDecayLR, "
            "WarmupCosineLR, OneCycle, LRRangeTest, got 'WarmupLr'",
        ),
        ({"checkpoint": {"tag_validation": "never"}}, "checkpoint.tag_validation must be one of Ignore, Warn, Fail"),
        ({"comm": {"timeout_s": 0}}, "comm.timeout_s must be > 0, got 0"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
        ({"wall_clock_breakdown": "auto"}, 'wall_clock_breakdown does not accept "auto"'),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device must be one of none, cpu, nvme, got 'gpu'; did you mean 'cpu'?",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}}},
            "zero_optimization.offload_optimizer.buffer_count must be a positive integer, got 0",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
            "zero_optimization.offload_optimizer.ratio=0.3 (a partial CPU step) is not supported",
        ),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer needs stage 1, 2 or 3",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param needs stage 3",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": 3}}},
            "zero_optimization.offload_optimizer.nvme_path must be a directory path",
        ),
        ({"aio": {"use_gds": True}}, "aio.use_gds=true (GPUDirect Storage) is not supported"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme"},
                    "offload_optimizer": {"device": "cpu"},
                }
            },
            'offload_param.device="nvme" needs offload_optimizer.device "nvme" too',
        ),
        ({"aio": {"block_size": 10}}, "aio.block_size must be"),
    ],
)
def test_bad_values_name_path_value_and_allowed(config, message):
    with pytest.raises(ConfigError) as info:
        _load(train_micro_batch_size_per_gpu=1, **config)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"amp": {"enabled": True}}, 'use "fp16" or "bf16" instead'),
        (
            {"optimizer": {"type": "MuAdam", "params": {"lr": 1e-3}}},
            "optimizer.type 'MuAdam' is not available in this version",
        ),
    ],
)
def test_features_not_built_yet_are_refused(config, message):
    with pytest.raises(ConfigError) as info:
        _load(train_micro_batch_size_per_gpu=1, **config)
    assert message in str(info.value)


def test_disabled_later_sections_are_accepted():
    config = _load(
        train_micro_batch_size_per_gpu=1,
        tensorboard={"enabled": False, "output_path": "x"},
        wandb={"enabled": False},
        flops_profiler={"enabled": False, "profile_step": 1},
        activation_checkpointing={"partition_activations": False, "number_checkpoints": 4},
        zero_optimization={"stage": 0, "offload_optimizer": {"device": "none"}},
    )
    assert config.zero.stage == 0


def test_activation_checkpointing_is_a_typed_section():
    config = _load(
        train_micro_batch_size_per_gpu=1,
        activation_checkpointing={
            "partition_activations": True,
            "cpu_checkpointing": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 8.0,
            "synchronize_checkpoint_boundary": True,
            "profile": True,
        },
    )
    section = config.activation_checkpointing
    assert section.partition_activations and section.cpu_checkpointing and section.contiguous_memory_optimization
    assert section.number_checkpoints == 8 and section.synchronize_checkpoint_boundary and section.profile
    assert _load(train_micro_batch_size_per_gpu=1).activation_checkpointing.number_checkpoints is None
    with pytest.raises(ConfigError, match="activation_checkpointing.number_checkpoints must be a positive integer"):
        _load(train_micro_batch_size_per_gpu=1, activation_checkpointing={"number_checkpoints": 0})
    with pytest.raises(ConfigError, match="activation_checkpointing.profile must be true or false"):
        _load(train_micro_batch_size_per_gpu=1, activation_checkpointing={"profile": "yes"})


def test_offload_sections_take_deepspeeds_names_and_defaults():
    config = _load(
        train_micro_batch_size_per_gpu=1,
        aio={"thread_count": 3},
        zero_optimization={"stage": 3, "offload_optimizer": {"device": "NVMe", "nvme_path": "/x"}},
    )
    off = config.zero.offload_optimizer
    assert (off.device, off.nvme_path, off.buffer_count, off.pin_memory, off.enabled) == ("nvme", "/x", 4, True, True)
    assert config.aio.intra_op_parallelism == 3 and config.aio.block_size == 1_048_576
    assert config.zero.offload_param.buffer_count == 5 and config.zero.offload_param.buffer_size == 100_000_000
    assert not config.zero.offload_param.enabled
    legacy = _load(train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 2, "cpu_offload": True})
    assert legacy.zero.offload_optimizer.device == "cpu"
    null = _load(train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 2, "offload_optimizer": None})
    assert not null.zero.offload_optimizer.enabled
    with pytest.raises(ConfigError, match="did you mean 'zero_optimization.offload_optimizer.device'"):
        _load(train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 2, "offload_optimizer": {"devise": "cpu"}})


def test_defaults_are_deepspeeds():
    config = _load(train_micro_batch_size_per_gpu=1)
    assert config.steps_per_print is None and config.gradient_clipping == 1.0  # DeepSpeed 0.19.8
    assert (
        config.fp16.enabled,
        config.fp16.loss_scale,
        config.fp16.initial_scale_power,
        config.fp16.loss_scale_window,
        config.fp16.hysteresis,
        config.fp16.min_loss_scale,
    ) == (False, 0.0, 16, 1000, 2, 1.0)
    assert config.zero.stage == 0 and config.zero.reduce_bucket_size == 500_000_000
    assert config.zero.stage3_param_persistence_threshold == 100_000
    assert config.checkpoint.tag_validation == "Warn"
    assert config.optimizer is None and config.scheduler is None


def test_hugging_face_style_auto_config_loads():
    config = _load(
        2,
        fp16={
            "enabled": "auto",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        bf16={"enabled": "auto"},
        optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        zero_optimization={
            "stage": 0,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
        },
        gradient_accumulation_steps="auto",
        gradient_clipping="auto",
        steps_per_print=2000,
        train_batch_size="auto",
        train_micro_batch_size_per_gpu=4,
        wall_clock_breakdown=False,
    )
    assert not config.fp16.enabled and not config.bf16.enabled
    assert dict(config.optimizer.params) == {}
    assert config.zero.allgather_bucket_size == 200_000_000 and isinstance(config.zero.allgather_bucket_size, int)
    assert config.batch.train_batch_size == 8


def test_json_file_and_errors(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True}}))
    config = load_config(str(path), world_size=2)
    assert isinstance(config, TrainConfig) and config.bf16.enabled
    assert load_config(config, world_size=2) is config
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"), world_size=1)
    path.write_text('{"train_batch_size": 8,\n "fp16": {enabled: true}}')
    with pytest.raises(ConfigError) as raised:
        load_config(path, world_size=1)
    # the file, line and column of the mistake (the unquoted key), not a bare JSONDecodeError
    assert str(path) in str(raised.value) and "line 2, column 11" in str(raised.value), raised.value


def test_legacy_names_map_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _load(
            train_micro_batch_size_per_gpu=1,
            bfloat16={"enabled": True},
            zero_optimization={"stage3_gather_fp16_weights_on_model_save": True},
        )
    assert config.bf16.enabled and config.zero.stage3_gather_16bit_weights_on_model_save
    assert {str(w.message).split("'")[1] for w in caught} == {
        "bfloat16",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    }


def test_a_sections_key_written_at_the_top_level_is_ignored_as_deepspeed_ignores_it(caplog):
    """TRL's prepare_deepspeed puts "zero_optimization.reduce_bucket_size" (and two more)
    at the top level of the reference model's config; DeepSpeed reads sections only."""
    import logging

    with caplog.at_level(logging.WARNING, logger="shardwise"):
        cfg = _load(
            train_micro_batch_size_per_gpu=1,
            zero_optimization={"stage": 3, "reduce_bucket_size": 1000},
            **{"zero_optimization.reduce_bucket_size": 64, "zero_optimization.stage3_prefetch_bucket_size": 57.6},
        )
    assert cfg.zero.stage == 3 and cfg.zero.reduce_bucket_size == 1000
    assert "zero_optimization.reduce_bucket_size (a section's key" in caplog.text
    with pytest.raises(ConfigError, match="unknown config key 'zero_optimisation.stage'"):
        _load(train_micro_batch_size_per_gpu=1, **{"zero_optimisation.stage": 3})
