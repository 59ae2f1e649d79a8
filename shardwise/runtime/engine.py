"""The training engine: sequences forward, backward and step; owns the step counters.

It holds no ZeRO, precision or checkpoint logic of its own: gradients and the optimizer
step belong to the ZeRO strategy, loss scaling to the loss scaler, files to
``shardwise.checkpoint``. The method names and return values follow DeepSpeed's engine
so existing training scripts run unchanged.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.comm import comms_logger_from_config
from shardwise.monitor import MonitorMaster
from shardwise.parallel import ParallelGrid
from shardwise.precision import LossScaler, PrecisionPolicy
from shardwise.runtime import _checkpointing, _full_state
from shardwise.runtime._checkpoint_state import ClientState, ModuleState, OptimizerState, Stateful
from shardwise.runtime._counters import StepCounters, counter
from shardwise.runtime._deepspeed_names import DeepSpeedNames
from shardwise.runtime._offload_states import StateOffloader
from shardwise.runtime._placement import placement
from shardwise.runtime._progress import ProgressReporter
from shardwise.runtime._training_features import build_training_features
from shardwise.runtime.data import engine_loader

# imported here also so that ``deepspeed.runtime.lr_schedules`` is an attribute after
# ``import deepspeed``, as in DeepSpeed (Accelerate reads VALID_LR_SCHEDULES that way)
from shardwise.runtime.lr_schedules import build_lr_scheduler
from shardwise.zero import ModelStateBytes, StepResult, build_strategy
from shardwise.zero._strategy import clip_coefficient

logger = logging.getLogger(__name__)


def _to_compute_device(model: nn.Module) -> None:
    """Move the model to this rank's device, as DeepSpeed's engine does (no-op on the CPU;
    a model with parameters still on the meta device is left for its owner to materialise)."""
    device = get_accelerator().device()
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in tensors) or all(t.device == device for t in tensors):
        return
    model.to(device)


class Engine(DeepSpeedNames, nn.Module):
    """Wraps a model for data-parallel training as configured by a ``TrainConfig``.

    Built by :func:`shardwise.initialize`; use ``engine(batch)`` for forward,
    ``engine.backward(loss)`` and ``engine.step()`` every micro-step. The optimizer steps
    on every ``gradient_accumulation_steps``-th call of ``step()`` (the boundary).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        config,
        grid: ParallelGrid,
        mpu=None,
        optimizer=None,
        model_parameters=None,
        lr_scheduler=None,
        training_data=None,
        collate_fn=None,
    ):
        super().__init__()
        self.module = model
        self.train_config = config
        self.config = dict(config.raw)
        """The config dict as given (DeepSpeed's ``engine.config``); ``train_config`` is the
        validated ``TrainConfig``."""
        self.grid = grid
        """The process grid (see [Note: the grid is the spine] in ``parallel/grid.py``)."""
        self.mpu = mpu if mpu is not None else grid
        """The ``mpu`` given to ``initialize`` (the grid when none was)."""
        self.comm = comm = grid.data_comm
        """Collectives over the data-parallel group."""
        self.policy = PrecisionPolicy.from_config(config)
        _to_compute_device(model)
        self.loss_scaler = LossScaler.from_config(config.fp16) if self.policy.loss_scaling else None
        self.strategy = build_strategy(model, config=config, comm=comm, policy=self.policy, grid=grid)
        self._client_optimizer = optimizer
        self.optimizer = self._configure_optimizer(optimizer, model_parameters)
        self.lr_scheduler = self._configure_lr_scheduler(lr_scheduler)
        if self.optimizer is not None:
            self.optimizer.overflow = False  # DeepSpeed's optimizers say whether the last step was skipped
        self.training_features = build_training_features(config, model)
        """What acts around the training step (see [Note: training features])."""
        self.training_dataloader = (
            self.deepspeed_io(training_data, collate_fn=collate_fn) if training_data is not None else None
        )
        self.counters = StepCounters()
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._last_result: StepResult | None = None
        if "comms_logger" in config.raw:  # DeepSpeed configures it only when the section is there
            comms_logger_from_config(config.monitor.comms_logger)
        self.monitor = MonitorMaster(config.monitor)
        """The monitors of the config (``engine.monitor.write_events([(tag, value, step)])``)."""
        self._progress = ProgressReporter(self, enabled=grid.global_rank == 0)
        self.strategy.timer = self._progress.timer
        self._offloader = StateOffloader(self.strategy, get_accelerator().device())

    global_steps = counter("global_steps")
    global_samples = counter("global_samples")
    micro_steps = counter("micro_steps")
    skipped_steps = counter("skipped_steps")

    # -- construction ---------------------------------------------------------------------

    def _configure_optimizer(self, client_optimizer, model_parameters):
        from shardwise.optim import build_optimizer

        if client_optimizer is not None and self.train_config.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to initialize() and the config has an "
                "'optimizer' section; keep only one of them"
            )
        params = model_parameters if model_parameters is not None else self.module.parameters()
        params = list(params) if not isinstance(params, list) else params
        if client_optimizer is None and self.train_config.optimizer is None:
            self.strategy.without_optimizer(params)
            return None
        if isinstance(client_optimizer, torch.optim.Optimizer):
            return self.strategy.adopt_client_optimizer(client_optimizer)
        mapped = self.strategy.optimizer_params(params)
        optimizer = (
            client_optimizer(mapped)
            if callable(client_optimizer)
            else build_optimizer(self.train_config.optimizer, mapped)
        )
        return self.strategy.adopt_client_optimizer(optimizer)

    def _configure_lr_scheduler(self, client_scheduler):
        if client_scheduler is not None:
            if self.train_config.scheduler is not None:
                logger.warning(
                    "both a client lr_scheduler and a config 'scheduler' section "
                    "were given; using the client scheduler as DeepSpeed does"
                )
            if (
                isinstance(client_scheduler, torch.optim.lr_scheduler.LRScheduler)
                or hasattr(client_scheduler, "state_dict")
                and hasattr(client_scheduler, "step")
            ):
                return client_scheduler
            return client_scheduler(self.optimizer)
        if self.train_config.scheduler is None:
            return None
        if self.optimizer is None:
            raise ValueError(
                "the config has a 'scheduler' section but no optimizer was given; "
                "add an 'optimizer' section or pass optimizer= to initialize()"
            )
        return build_lr_scheduler(self.train_config.scheduler, self.optimizer)

    # -- the training step ------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module (floating inputs cast to fp16 when fp16.auto_cast); a
        training forward also gets the training features' keywords."""
        kwargs.update(self.training_features.forward_kwargs(self.module, self.global_steps))
        with self._progress.timer("forward"):
            return self.module(*self.policy.cast_inputs(inputs), **self.policy.cast_inputs(kwargs))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss``; at the accumulation boundary the gradients are reduced
        across ranks (overlapped with backward) and averaged before this returns."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "engine.backward() expects a scalar loss tensor, got "
                f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}"
            )
        with self._progress.timer("backward"):
            self.strategy.pre_backward(boundary=self.is_gradient_accumulation_boundary(), sync=not self._no_sync)
            scaled = loss.float()
            gas = self.gradient_accumulation_steps()
            if scale_wrt_gas and gas > 1:
                scaled = scaled / gas
            if self.loss_scaler is not None:
                scaled = scaled * self.loss_scaler.scale
            with self._progress.timer("backward_inner"):
                scaled.backward(retain_graph=retain_graph)
            with self._progress.timer("backward_allreduce"):
                self.strategy.finalize_backward()
        self._progress.record_loss(loss)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro-step; at the accumulation boundary update the parameters."""
        with self._progress.timer("step"):
            if self.is_gradient_accumulation_boundary():
                self.training_features.before_model_step(self.global_steps)
                self._take_model_step(lr_kwargs)
            self.micro_steps += 1
            self.global_samples += self.train_micro_batch_size_per_gpu() * self.comm.world_size
            self._boundary_override = None
        if self._last_result is not None and self.micro_steps % self.gradient_accumulation_steps() == 0:
            self._progress.after_model_step()

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step() needs an optimizer: add an 'optimizer' section "
                "to the config or pass optimizer= to initialize()"
            )
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        max_norm = self.train_config.gradient_clipping
        result = self.strategy.step(max_grad_norm=max_norm, loss_scale=scale)
        self._last_result = result
        coef = clip_coefficient(max_norm, result.grad_norm) if result.applied else None  # None: skipped
        self.training_features.after_optimizer_step(self.global_steps, coef)
        self.optimizer.overflow = not result.applied
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not result.applied)
        if result.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            if self.grid.global_rank == 0:
                after = self.loss_scaler.scale if self.loss_scaler is not None else scale
                logger.info(
                    "step %d: gradient overflow (norm %s); skipped the update, loss scale %g -> %g",
                    self.global_steps + 1,
                    result.grad_norm,
                    scale,
                    after,
                )
        self.global_steps += 1

    def zero_grad(self) -> None:
        """Clear accumulated gradients (the engine also does this after every step)."""
        self.strategy.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the gradient all-reduce for backward passes inside this context."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # -- DeepSpeed-compatible accessors ---------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last of its accumulation window."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary decision for the current micro-step."""
        self._boundary_override = bool(is_boundary)

    def get_lr(self) -> list[float]:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        if self.optimizer is None:
            return []
        return [g.get("betas", (g.get("momentum"),))[0] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm (before clipping) of the last optimizer step, None before any."""
        return None if self._last_result is None else self._last_result.grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped for an fp16 overflow."""
        return self._last_result is not None and self._last_result.applied

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def model_state_bytes(self) -> ModelStateBytes:
        """Exact bytes of parameters, gradients, master weights and optimizer state here."""
        return self.strategy.views.model_state_bytes()

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    @property
    def dp_world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        import os

        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def deepspeed_io(
        self,
        dataset,
        batch_size=None,
        route=None,
        pin_memory=True,
        data_sampler=None,
        collate_fn=None,
        num_local_io_workers=None,
    ):
        """A DataLoader over ``dataset`` that gives each data-parallel rank its own shard (its
        micro-batches from the curriculum sampler under ``data_efficiency``'s data sampling)."""
        del route
        return engine_loader(
            self,
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            pin_memory=pin_memory and self.device.type == "cuda",
            data_sampler=data_sampler,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
        )

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Save module, optimizer, scheduler, scaler, counters, RNG and ``client_state``
        under ``save_dir/tag`` (default tag ``global_step<N>``). Collective: call on every rank."""
        return _checkpointing.save(
            self._stateful(client_state or {}),
            self._placement(),
            save_dir,
            tag=tag,
            save_latest=save_latest,
            tag_validation=self.train_config.checkpoint.tag_validation,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        """Load a checkpoint saved by :meth:`save_checkpoint`; returns ``(path, client_state)``."""
        return _checkpointing.load(
            self._stateful(),
            self._placement(),
            load_dir,
            tag=tag,
            strict=load_module_strict,
            load_optimizer=load_optimizer_states and not load_module_only,
            load_scheduler=load_lr_scheduler_states and not load_module_only,
            module_only=load_module_only,
        )

    def _stateful(self, client_state: dict | None = None) -> Stateful:
        """What a checkpoint saves and restores (see ``runtime/_checkpoint_state.py``)."""
        optimizer = OptimizerState(self.strategy.views, self.optimizer) if self.optimizer is not None else None
        return Stateful(
            ModuleState(self.strategy.views, param_dtype=self.policy.param_dtype),
            optimizer,
            self.lr_scheduler,
            self.loss_scaler,
            self.counters,
            self.gradient_accumulation_steps(),
            client=ClientState(client_state or {}),
            features=self.training_features,
        )

    def _placement(self):
        """Which names of a checkpoint this rank holds (see ``runtime/_placement.py``)."""
        return placement(self.module, self.grid, zero_stage=self.train_config.zero.stage)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """Save the module's weights in their training dtype (fp16/bf16, or fp32) as one file.
        Collective: call on every rank. For full fp32 weights of a mixed-precision run use
        ``shardwise.checkpoint.consolidate`` (or ``shardwise convert``) on a checkpoint."""
        exclude = _full_state.frozen_names(self.module) if exclude_frozen_parameters else frozenset()
        return _full_state.save_16bit_model(
            self._stateful().module, self._placement(), save_dir, save_filename, exclude=exclude
        )

    save_fp16_model = save_16bit_model

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """The module's full state dict (collective at stage 3, which gathers it, and under
        tensor parallelism, whose slices are gathered into the full tensors, as in the model
        without it)."""
        del destination, keep_vars
        exclude = _full_state.frozen_names(self.module) if exclude_frozen_parameters else frozenset()
        local = self.strategy.views.module_state_dict()
        state = _full_state.full_module_state(local, self._placement(), exclude=exclude)
        return {prefix + k: v for k, v in state.items()}

    def load_module_state_dict(
        self,
        checkpoint: dict,
        strict=True,
        custom_load_fn=None,
        fetch_z3_params=False,
        z3_params_to_fetch=None,
        allowed_missing_keys=None,
    ):
        """Load ``checkpoint["module"]`` (a full state dict) into the model at any stage;
        with ``custom_load_fn(src=state, dst=module)`` that function does the copying
        (inside ``GatheredParameters`` of the listed or, with ``fetch_z3_params``, all
        parameters at stage 3) and the fp32 masters are refreshed from the result. Under
        tensor parallelism the full tensors are cut to this rank's slices first. Returns
        None, as DeepSpeed's does."""
        state = _checkpointing.module_state_for_layout(checkpoint["module"], self._placement())
        if custom_load_fn is None:
            result = self.strategy.views.load_module_state_dict(state, strict=strict and allowed_missing_keys is None)
            unexpected_missing = set(result.missing_keys) - set(allowed_missing_keys or ())
            if strict and allowed_missing_keys is not None and (unexpected_missing or result.unexpected_keys):
                raise RuntimeError(
                    f"module state does not match the model: missing {sorted(unexpected_missing)}, "
                    f"unexpected {sorted(result.unexpected_keys)}"
                )
            return None
        from shardwise.zero import GatheredParameters

        fetch = (
            list(z3_params_to_fetch)
            if z3_params_to_fetch is not None
            else list(self.module.parameters())
            if fetch_z3_params
            else []
        )
        with GatheredParameters(fetch, modifier_rank=0):
            custom_load_fn(src=state, dst=self.module)
        self.strategy.views.reset_master_from_params()
        return None

    # -- moving state off the device ------------------------------------------------------

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """Move the state kinds in ``include`` (DeepSpeed's ``OffloadStateTypeEnum``:
        ``optim_states``, ``hp_params``, ``lp_params``, ``lp_grads``,
        ``contiguous_grad_buffer``; None: all) to host memory, freeing their device memory.
        Call ``reload_states()`` before training again. See [Note: offloading by storage]
        in ``runtime/_offload_states.py``."""
        if self.train_config.zero.offload_param.enabled:
            raise ValueError(
                "offload_states() is not supported with offload_param: the parameters live off the device already"
            )
        self._offloader.offload(include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved, into the same tensors."""
        self._offloader.reload(non_blocking=non_blocking)

    def __getattr__(self, name: str):
        """Attributes the engine lacks come from the wrapped module, as in DeepSpeed
        (``engine.config`` is the engine's; ``engine.model`` reaches ``module.model``).
        Dunder names are not passed through (copy and pickle probe them), and before
        ``module`` is set nothing is (no recursion while the engine is built)."""
        try:
            return super().__getattr__(name)  # nn.Module's parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or (name.startswith("__") and name.endswith("__")):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither the {type(self).__name__} nor its wrapped module "
                f"({type(module).__name__}) has an attribute {name!r}"
            ) from None

    def __repr__(self) -> str:  # the module repr is long; keep the engine's short
        return (
            f"Engine(zero_stage={self.train_config.zero.stage}, dtype={self.policy.param_dtype}, "
            f"dp_world_size={self.comm.world_size}, module={type(self.module).__name__})"
        )


DeepSpeedEngine = Engine
"""DeepSpeed's name for the engine class (``deepspeed.runtime.engine.DeepSpeedEngine``)."""
