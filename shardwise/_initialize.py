"""``shardwise.initialize``: DeepSpeed's entry point, same signature and return values."""

from __future__ import annotations

import argparse
import logging

import torch.distributed as dist

from shardwise.comm import init_distributed
from shardwise.config import load_config
from shardwise.config._tensor_parallel import check_tensor_parallel
from shardwise.moe._autoep import apply_autoep
from shardwise.moe._bind import bind_moe_layers
from shardwise.parallel import ParallelGrid
from shardwise.sequence._setup import setup_sequence_parallel
from shardwise.tensor_parallel.autotp import apply_autotp, resolve_policy
from shardwise.utils import groups

logger = logging.getLogger("shardwise")


def _config_source(args, config, config_params):
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params) if c is not None]
    if len(given) > 1:
        raise ValueError("both config= and config_params= were given to initialize(); pass one")
    if given and from_args is not None:
        raise ValueError(
            f"a config was passed to initialize() and also on the command line "
            f"(--deepspeed_config {from_args}); keep only one"
        )
    source = given[0] if given else from_args
    if source is None:
        raise ValueError(
            "no config: pass config= (a dict or a JSON file path) to initialize(), "
            "or --deepspeed_config on the command line "
            "(add the flags with shardwise.add_config_arguments(parser))"
        )
    return source


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    config_params=None,
):
    """Wrap ``model`` for training as the config says; DeepSpeed's ``initialize``.

    Starts torch.distributed if needed (from torchrun/SLURM/MPI variables, or a world of
    one), reads and validates the config, broadcasts parameters from rank 0 and builds the
    optimizer, LR scheduler and data loader.

    Args:
        args: an argparse namespace; ``args.deepspeed_config`` (or the deprecated
            ``args.deepscale_config``) may name the config file.
        model: the ``torch.nn.Module`` to train (required).
        optimizer: a ``torch.optim.Optimizer``, or a callable building one from parameters;
            excludes an ``optimizer`` section in the config.
        model_parameters: parameters or param-group dicts to optimize (default: all).
        training_data: a Dataset; a distributed loader over it is returned.
        lr_scheduler: a scheduler object, or a callable taking the optimizer.
        mpu: a Megatron-style model-parallel unit (``get_data_parallel_group/rank/world_size``,
            ``get_tensor_model_parallel_*``, optionally ``get_pipeline_model_parallel_*``) or
            a :class:`shardwise.parallel.ParallelGrid`: ZeRO then partitions and reduces over
            its data-parallel group, and the gradient norm is summed over its tensor and
            pipeline groups. Without one, every rank is a data-parallel replica.
        dist_init_required: False when the caller initialises torch.distributed.
        collate_fn: collate function for the returned loader.
        config: a dict or a path to a DeepSpeed-style JSON config.
        config_params: the same as ``config`` (DeepSpeed's older name).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; the last three may be None.
    """
    from shardwise.pipe.engine import PipelineEngine
    from shardwise.pipe.module import PipelineModule
    from shardwise.runtime.engine import Engine
    from shardwise.runtime.hybrid_engine import HybridEngine

    if model is None:
        raise ValueError("initialize() needs model=<torch.nn.Module>")
    source = _config_source(args, config, config_params)
    init_distributed(dist_init_required=dist_init_required)
    if not dist.is_initialized():
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group() first"
        )
    tp_section = _raw_config(source).get("tensor_parallel")
    tp_size = _merge_tp_model_init(model, check_tensor_parallel(tp_section))
    if tp_size > 1 and mpu is not None:
        raise ValueError(
            f"both mpu= and tensor_parallel.autotp_size={tp_size} were given: the mpu's groups already "
            "decide the tensor parallelism (its layers are split by the model's code); remove one"
        )
    if tp_size > 1 and dist.get_world_size() % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size={tp_size} does not divide the {dist.get_world_size()} "
            "rank(s): each tensor-parallel group needs autotp_size ranks; change autotp_size or the "
            "number of processes"
        )
    pipeline = isinstance(model, PipelineModule)
    if pipeline and (mpu is not None or tp_size > 1):
        raise ValueError(
            "a PipelineModule brings its own grid (num_stages= / topology=); give tensor parallelism "
            "through its topology's 'model' axis, not mpu= or tensor_parallel.autotp_size"
        )
    if not pipeline and _raw_config(source).get("pipeline"):
        logger.warning(
            "the config's 'pipeline' section applies to shardwise.pipe.PipelineModule models only; "
            "it has no effect on %s",
            type(model).__name__,
        )
    if pipeline:
        grid = model.mpu()
    else:
        grid = ParallelGrid.from_mpu(mpu) if mpu is not None else ParallelGrid.build(tensor=max(tp_size, 1))
    setup_sequence_parallel(model, grid, _raw_config(source), pipeline=pipeline)
    cfg = load_config(source, world_size=grid.replicas)
    grid.configure_comms(timeout_s=cfg.comm.timeout_s, check_hangs=cfg.comm.check_hangs)
    split_experts = bind_moe_layers(model, grid, cfg, pipeline=pipeline)
    split_experts.update(apply_autoep(model, grid, cfg, pipeline=pipeline))
    model_parameters = (
        _remap_parameters(split_experts, optimizer, model_parameters) if split_experts else model_parameters
    )
    if tp_size > 1:
        replaced = apply_autotp(model, grid.tensor_comm, policy=resolve_policy(model, tp_section))
        model_parameters = _remap_parameters(replaced, optimizer, model_parameters)
    if dist.get_rank() == 0:
        logger.info(
            "shardwise: %d rank(s) (pipe %d x data %d x tensor %d), micro-batch %d x accumulation %d = batch %d",
            dist.get_world_size(),
            grid.pipe,
            grid.data,
            grid.tensor,
            cfg.batch.train_micro_batch_size_per_gpu,
            cfg.batch.gradient_accumulation_steps,
            cfg.batch.train_batch_size,
        )
    if pipeline and cfg.hybrid_engine.enabled:
        raise ValueError(
            "hybrid_engine.enabled with a PipelineModule: the hybrid engine generates with a whole model on "
            "each rank; train a pipeline without it, or the model without a pipeline"
        )
    engine_type = PipelineEngine if pipeline else HybridEngine if cfg.hybrid_engine.enabled else Engine
    engine = engine_type(
        model=model,
        config=cfg,
        grid=grid,
        mpu=mpu,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    groups._set_grid(grid)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _remap_parameters(replaced: dict, optimizer, model_parameters):
    """Point an optimizer or parameter list built before ``initialize`` at the shards AutoTP
    (AutoEP, tensor-parallel experts) put in place of the full parameters (``replaced``:
    old parameter -> new)."""
    import torch

    def swap(params):
        return [replaced.get(p, p) for p in params]

    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(
                "tensor_parallel.autotp_size / expert_parallel / enable_expert_tensor_parallelism: the optimizer "
                "passed to initialize() already has state for the full parameters AutoTP / AutoEP / tensor-parallel "
                "experts split; build it before its first step, or "
                "pass it as a callable (params -> optimizer)"
            )
        for group in optimizer.param_groups:
            group["params"] = swap(group["params"])
    if model_parameters is not None:
        model_parameters = [
            dict(g, params=swap(g["params"])) if isinstance(g, dict) else replaced.get(g, g) for g in model_parameters
        ]
    return model_parameters


def _merge_tp_model_init(model, config_size: int) -> int:
    """The tensor-parallel size: the config's, or the one ``tp_model_init`` recorded."""
    recorded = getattr(model, "_shardwise_tp_model_init", None)
    if recorded is None:
        return config_size
    if config_size > 1 and config_size != recorded["tp_size"]:
        raise ValueError(
            f"tp_model_init(tp_size={recorded['tp_size']}) and the config's "
            f"tensor_parallel.autotp_size={config_size} disagree; make them equal or drop one"
        )
    return recorded["tp_size"]


def _raw_config(source) -> dict:
    """The config as a dict, for the sections read before the config is validated."""
    from shardwise.config import TrainConfig
    from shardwise.config.from_dict import _read

    return dict(source.raw) if isinstance(source, TrainConfig) else _read(source)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags to ``parser`` and return it; DeepSpeed's function.

    Adds exactly ``--deepspeed``, ``--deepspeed_config`` and their deprecated spellings
    ``--deepscale``, ``--deepscale_config``, as DeepSpeed does. It adds no ``--local_rank``:
    scripts that run under ``shardwise run`` (which passes ``--local_rank=N`` as DeepSpeed's
    launcher does, unless ``--no_local_rank``) define that flag themselves.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable DeepSpeed-style training (accepted; shardwise is always on)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="path to the DeepSpeed-style JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated spelling of --deepspeed_config")
    return parser


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """DeepSpeed's ``tp_model_init``: record that ``model`` is to be trained with tensor
    parallelism of ``tp_size`` and return it unchanged; :func:`initialize` splits it (as
    ``tensor_parallel.autotp_size`` would; a config that sets a different size is an
    error). The training dtype comes from the config's ``fp16`` / ``bf16`` sections;
    ``dtype`` is recorded only. The tensor group is the grid's, so ``tp_group=`` is
    refused."""
    del config
    if kwargs.get("tp_group") is not None:
        raise NotImplementedError(
            "tp_model_init(tp_group=...): shardwise builds the tensor-parallel groups from its "
            "grid (tensor innermost); leave tp_group out, or pass your groups as initialize(mpu=...) "
            "with Megatron-style layers"
        )
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init() got unexpected keyword arguments {sorted(unknown)}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    model._shardwise_tp_model_init = {"tp_size": tp_size, "dtype": dtype}
    return model
