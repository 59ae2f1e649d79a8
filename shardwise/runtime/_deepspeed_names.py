"""DeepSpeed's engine methods that only report or adjust settings, kept apart from the
engine's training logic. Each returns what DeepSpeed's method of the same name returns.

The engine keeps its validated config as ``engine.train_config`` (a ``TrainConfig``);
``engine.config`` is the config dict as given, as in DeepSpeed (Hugging Face reads it).
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import torch

from shardwise.accelerator import get_accelerator
from shardwise.config._components import BatchConfig
from shardwise.runtime._throughput import ThroughputTimer


class DeepSpeedNames:
    """Mixed into :class:`~shardwise.runtime.engine.Engine`."""

    # -- the pipeline engine's entry points, on an engine that is not one -------------------

    def train_batch(self, data_iter=None):
        raise RuntimeError(
            "train_batch() runs a pipeline: the model passed to initialize() must be a "
            "shardwise.pipe.PipelineModule; for other models call engine(batch), "
            "engine.backward(loss) and engine.step()"
        )

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg"):
        raise RuntimeError(
            "eval_batch() runs a pipeline: the model passed to initialize() must be a "
            "shardwise.pipe.PipelineModule; for other models call engine(batch) under torch.no_grad()"
        )

    @functools.cached_property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput timer, made on first use (see ``_throughput.py``)."""
        return ThroughputTimer(self)

    # -- batch sizes ------------------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self.train_config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.train_config.batch.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.train_config.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        batch = self.train_config.batch
        return batch.train_batch_size, batch.train_micro_batch_size_per_gpu, batch.gradient_accumulation_steps

    def _set_batch(self, micro: int, accumulation: int) -> None:
        batch = BatchConfig(
            train_batch_size=micro * accumulation * self.dp_world_size,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accumulation,
        )
        self.train_config = dataclasses.replace(self.train_config, batch=batch)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the number of accumulated micro-batches
        (the micro-batch size stays). Raises ValueError unless it divides evenly."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError(
                f"train batch size {train_batch_size} must be divisible by micro-batch size x "
                f"data-parallel size = {per_step}"
            )
        self._set_batch(self.train_micro_batch_size_per_gpu(), train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping the accumulation steps (the global batch
        changes with it). Loaders already built keep their batch size, as in DeepSpeed."""
        self._set_batch(int(micro_batch_size), self.gradient_accumulation_steps())

    # -- settings -----------------------------------------------------------------------------

    def zero_optimization_stage(self) -> int:
        return self.train_config.zero.stage

    def fp16_enabled(self) -> bool:
        return self.train_config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.train_config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.train_config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.train_config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.train_config.wall_clock_breakdown

    def loss_scale(self) -> float:
        """The configured static fp16 loss scale (0: dynamic); ``get_loss_scale()`` gives the current one."""
        return self.train_config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.train_config.fp16.loss_scale == 0

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's optimizer type."""
        if self._client_optimizer is not None:
            return type(self._client_optimizer).__name__
        return None if self.train_config.optimizer is None else self.train_config.optimizer.type

    def postscale_gradients(self) -> bool:
        return not self.train_config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.train_config.gradient_predivide_factor

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's, else the training dtype."""
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        chosen = self.train_config.communication_data_type
        return names[chosen] if chosen is not None else self.policy.param_dtype

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``: the same dtype here."""
        return self.policy.param_dtype, self.policy.param_dtype

    def zero_optimization(self) -> bool:
        return self.train_config.zero.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.train_config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.train_config.zero.stage >= 3

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` config (``.device``: "none", "cpu" or "nvme")."""
        return self.train_config.zero.offload_optimizer

    def zero_offload_param(self):
        """The ``offload_param`` config."""
        return self.train_config.zero.offload_param

    def zero_cpu_offload(self) -> bool:
        offload = self.train_config.zero.offload_optimizer
        return offload.enabled and offload.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        offload = self.train_config.zero.offload_optimizer
        return offload.enabled and offload.device in ("cpu", "nvme")

    def zero_reduce_bucket_size(self) -> int:
        return self.train_config.zero.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.train_config.zero.allgather_bucket_size

    def zero_sub_group_size(self) -> int:
        return self.train_config.zero.sub_group_size

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.train_config.zero.stage3_gather_16bit_weights_on_model_save

    def zero_allow_untested_optimizer(self) -> bool:
        return self.train_config.zero_allow_untested_optimizer

    # -- mixture of experts ----------------------------------------------------------------------

    @property
    def has_moe_layers(self) -> bool:
        """Whether the model has ``shardwise.moe.layer.MoE`` layers (DeepSpeed's attribute)."""
        return bool(self.moe_layers)

    @property
    def moe_layers(self) -> list:
        from shardwise.moe._bind import moe_layers

        return moe_layers(self.module)

    @property
    def num_experts(self) -> list[int]:
        """Each MoE layer's number of experts, in module order."""
        return [layer.num_experts for layer in self.moe_layers]

    def sparse_attention_config(self, num_heads: int):
        """The sparsity config the ``sparse_attention`` section describes, for a layer of
        ``num_heads`` heads (None without the section); pass it to ``SparseSelfAttention``."""
        from shardwise.ops.sparse_attention import sparsity_config_from_dict

        return sparsity_config_from_dict(self.config.get("sparse_attention"), num_heads)

    # -- the legacy curriculum and progressive layer drop (runtime/data_pipeline/) -----------

    def curriculum_enabled_legacy(self) -> bool:
        return self.train_config.curriculum_learning.enabled

    def curriculum_params_legacy(self) -> dict:
        """The ``curriculum_learning`` section without ``enabled``."""
        return self.train_config.curriculum_learning.scheduler_config()

    @property
    def curriculum_scheduler_legacy(self):
        """The legacy curriculum's ``CurriculumScheduler`` (DeepSpeed's attribute; None when off)."""
        curriculum = self.training_features.find("curriculum_learning")
        return None if curriculum is None else curriculum.scheduler

    @property
    def progressive_layer_drop(self):
        """The ``ProgressiveLayerDrop`` schedule (DeepSpeed's attribute; None when off)."""
        layer_drop = self.training_features.find("progressive_layer_drop")
        return None if layer_drop is None else layer_drop.schedule

    def set_custom_curriculum_learning_schedule(self, schedule_function) -> None:
        """Give a ``custom`` curriculum schedule its function: a dict ``{metric: fn}`` for the
        metrics of ``data_efficiency``'s curriculum sampler (DeepSpeed 0.19.8's form; the
        training loader must exist), or one ``fn(global_steps) -> difficulty`` for the
        top-level ``curriculum_learning`` section."""
        if isinstance(schedule_function, dict):
            sampler = getattr(self.training_dataloader, "data_sampler", None)
            if not hasattr(sampler, "set_custom_curriculum_learning_schedule"):
                raise ValueError(
                    "set_custom_curriculum_learning_schedule({metric: fn}) sets the schedules of the "
                    "data_efficiency curriculum sampler, which needs data_sampling.curriculum_learning enabled "
                    "and the training loader built (initialize(training_data=...))"
                )
            sampler.set_custom_curriculum_learning_schedule(schedule_function)
            return
        scheduler = self.curriculum_scheduler_legacy
        if scheduler is None or not callable(schedule_function):
            raise ValueError(
                "set_custom_curriculum_learning_schedule(fn) sets the schedule of the top-level "
                "'curriculum_learning' section, which must be enabled, and fn must be a function of the "
                f"step (for the data_efficiency sampler pass {{metric: fn}}); got {schedule_function!r}"
            )
        scheduler.set_custom_get_difficulty(schedule_function)

    def set_data_post_process_func(self, post_process_func) -> None:
        """Apply ``post_process_func(batch, data_sampler_state)`` to every batch of the
        curriculum sampler's training loader (DeepSpeed's; nothing without that loader)."""
        if hasattr(self.training_dataloader, "post_process_func"):
            self.training_dataloader.post_process_func = post_process_func

    def get_pld_theta(self) -> float | None:
        """Progressive layer drop's keep probability now (None when it is off)."""
        return None if self.progressive_layer_drop is None else self.progressive_layer_drop.get_theta()

    # -- saving -----------------------------------------------------------------------------

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False) -> dict:
        """The full state dict in the training dtype on global rank 0, ``{}`` elsewhere
        (collective; what Hugging Face saves under ZeRO-3). Stage 3 gathers it a unit at a
        time (``module_state_pieces``), so only rank 0 ever holds all of it. A parameter
        reachable under several keys (tied embeddings) is one tensor under all of them, as
        in DeepSpeed, so ``save_pretrained`` recognises the tie and writes it once."""
        frozen = (
            {n for n, p in self.module.named_parameters() if not p.requires_grad}
            if exclude_frozen_parameters
            else set()
        )
        holders = self.module.state_dict(keep_vars=True)
        rank0 = self.global_rank == 0
        first_key: dict[int, str] = {}
        consolidated = {}
        for piece in self.strategy.views.module_state_pieces():  # every rank takes every piece
            for key, tensor in piece.items() if rank0 else ():
                if key in frozen:
                    continue
                owner = first_key.setdefault(id(holders[key]), key)
                consolidated[key] = consolidated[owner] if owner in consolidated else tensor.detach().cpu().clone()
        return consolidated

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    # -- memory -------------------------------------------------------------------------------

    def empty_partition_cache(self) -> None:
        """Release parameters stage 3 holds gathered (e.g. after evaluation) and the
        allocator's cached blocks; other stages keep whole parameters by design."""
        self.strategy.release_gathered()
        gc.collect()
        get_accelerator().empty_cache()

    def destroy(self) -> None:
        """Release what the engine holds outside the model: swap files and their I/O
        threads, gathered stage-3 parameters, cached device memory. The engine must not
        be used afterwards."""
        self.strategy.release_gathered()
        swapper = getattr(self.strategy, "swapper", None)
        if swapper is not None:
            swapper.close()
        gc.collect()
        get_accelerator().empty_cache()
