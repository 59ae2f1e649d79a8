"""``DeepSpeedConfig``: DeepSpeed's name for a parsed config, over shardwise's ``TrainConfig``."""

from __future__ import annotations

from shardwise.config import load_config


class DeepSpeedConfig:
    """A validated config with DeepSpeed's attribute names for what scripts read.

    Args:
        config: a dict or the path of a DeepSpeed-style JSON file.
        mpu: must be None (model parallelism is not built yet).
        mesh_device: accepted for DeepSpeed compatibility (must be None).
    """

    def __init__(self, config, mpu=None, mesh_device=None):
        if mpu is not None or mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mpu=..., mesh_device=...): model parallelism is not "
                                      "available in this version of shardwise yet")
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.config = load_config(config, world_size=world_size)
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
    def steps_per_print(self) -> int:
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
