"""``DeepSpeedConfig``: DeepSpeed's name for a parsed config, over shardwise's ``TrainConfig``."""

from __future__ import annotations

from shardwise.config import ConfigError, load_config

DeepSpeedConfigError = ConfigError
"""DeepSpeed's name for a config error."""

# DeepSpeed's optimizer type names (``optimizer.type``, compared lower-case)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"


def _data_parallel_size(mpu, mesh_device) -> int:
    """The data-parallel size the batch triangle is resolved for, as DeepSpeed finds it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1
    if mpu is not None:
        if not hasattr(mpu, "get_data_parallel_world_size"):
            raise ValueError(
                f"DeepSpeedConfig(mpu=...): {type(mpu).__name__} has no get_data_parallel_world_size(); "
                "pass a Megatron-style mpu or a shardwise ParallelGrid"
            )
        return mpu.get_data_parallel_world_size()
    if mesh_device is not None:
        return dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    return dist.get_world_size()


class DeepSpeedConfig:
    """A validated config with DeepSpeed's attribute names for what scripts read.

    Args:
        config: a dict or the path of a DeepSpeed-style JSON file.
        mpu: a Megatron-style model-parallel unit (or a ``ParallelGrid``): the batch sizes
            are resolved over its data-parallel size instead of the world size.
        mesh_device: a ``DeviceMesh`` with a ``"data_parallel"`` dimension, used the same way.
    """

    def __init__(self, config, mpu=None, mesh_device=None):
        self.config = load_config(config, world_size=_data_parallel_size(mpu, mesh_device))
        """The shardwise ``TrainConfig``."""
        self._param_dict = dict(self.config.raw)

    @property
    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.train_micro_batch_size_per_gpu

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    @property
    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    @property
    def zero_enabled(self) -> bool:
        return self.config.zero.stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    @property
    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    @property
    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    @property
    def sparse_attention(self) -> dict | None:
        """The ``sparse_attention`` section with DeepSpeed's defaults filled in (None if absent)."""
        from shardwise.config._sparse_attention import sparse_attention_section

        return sparse_attention_section(self._param_dict.get("sparse_attention"))

    def print(self, name: str) -> None:
        """Print the config as given, under ``name``."""
        import json

        print(f"{name}:\n{json.dumps(self._param_dict, indent=2, sort_keys=True, default=str)}")
