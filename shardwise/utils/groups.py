"""DeepSpeed's ``deepspeed.utils.groups`` accessors for the process groups of training.

They answer from the process grid of the engine built last by :func:`shardwise.initialize`
(DeepSpeed keeps the same kind of process-wide record); before any engine exists every
rank is a data-parallel replica: the data-parallel group is the world and the tensor- and
pipeline-parallel sizes are 1. Shardwise's own code never reads these: it gets its groups
from the grid it is handed (see [Note: the grid is the spine] in ``parallel/grid.py``).
As in DeepSpeed, the accessors need torch.distributed to be started, and asking for a
tensor- or sequence-parallel *group* where none exists is an error.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

_grid_ref = None  # a weak reference to the grid of the engine built last


def _set_grid(grid) -> None:
    """Record ``grid`` as the one these accessors answer from (called by ``initialize``)."""
    global _grid_ref
    _grid_ref = weakref.ref(grid) if grid is not None else None


def _grid():
    _require_initialized()
    return _grid_ref() if _grid_ref is not None else None


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized; call shardwise.init_distributed() or shardwise.initialize() first"
        )


def get_data_parallel_group():
    """The data-parallel process group (the world when no grid splits it)."""
    grid = _grid()
    return grid.get_data_parallel_group() if grid is not None else dist.group.WORLD


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(group=get_data_parallel_group())


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel size (1 without tensor parallelism)."""
    grid = _grid()
    return grid.tensor if grid is not None else 1


def get_tensor_model_parallel_rank() -> int:
    grid = _grid()
    return grid.tensor_rank if grid is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    grid = _grid()
    return grid.get_tensor_model_parallel_src_rank() if grid is not None else dist.get_rank()


def get_tensor_model_parallel_group():
    grid = _grid()
    if grid is None or grid.tensor == 1:
        raise RuntimeError(
            "no tensor-parallel group: the job trains without tensor parallelism "
            "(set tensor_parallel.autotp_size or pass mpu= to initialize())"
        )
    return grid.get_tensor_model_parallel_group()


get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_group = get_tensor_model_parallel_group

_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_sequence_data_parallel_group = get_data_parallel_group
_get_sequence_data_parallel_world_size = get_data_parallel_world_size
_get_sequence_data_parallel_rank = get_data_parallel_rank


def _get_data_parallel_group_ranks():
    grid = _grid()
    return grid.get_data_parallel_group_ranks() if grid is not None else range(dist.get_world_size())


def _get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def _get_sequence_parallel_world_size() -> int:
    """The sequence-parallel size (1 without ``sequence_parallel_size``)."""
    grid = _grid()
    return grid.sequence if grid is not None else 1


def _get_sequence_parallel_rank() -> int:
    grid = _grid()
    return grid.get_sequence_parallel_rank() if grid is not None else 0


def _get_sequence_parallel_group():
    grid = _grid()
    if grid is None or grid.sequence == 1:
        raise KeyError(
            "No sequence parallel group found: the job does not split sequences (set sequence_parallel_size "
            "in the config, or build the groups with UlyssesSPAttentionHF.register_with_transformers)"
        )
    return grid.get_sequence_parallel_group()


def _get_broadcast_src_rank() -> int:
    return 0


# -- expert parallelism (see [Note: expert groups] in parallel/_expert.py) ---------------

_default_grid = None  # the data-parallel grid built when MoE groups are asked for before any engine


def initialize(ep_size=1, mpu=None):
    """DeepSpeed's retired call: refused, as DeepSpeed does, naming what replaced it."""
    raise RuntimeError(
        "deepspeed.utils.groups.initialize() is deprecated (DeepSpeed raises too): pass ep_size to "
        "deepspeed.moe.layer.MoE(..., ep_size=...) and initialize() builds the expert groups"
    )


def _grid_or_default():
    """The recorded grid, or a data-parallel grid over the world (built once, collective)."""
    global _default_grid
    grid = _grid()
    if grid is None:
        if _default_grid is None:
            from shardwise.parallel import ParallelGrid

            _default_grid = ParallelGrid.build()
        grid = _default_grid
    return grid


def _create_expert_and_data_parallel(
    expert_parallel_size_,
    mp_size=None,
    pp_size=None,
    mp_mode="tp",
    use_data_before_expert_parallel_=False,
    folding_spec=None,
):
    """Build the expert groups of ``expert_parallel_size_`` on the grid (collective). The
    model-parallel sizes are the grid's: others, and AutoEP's folding, are refused."""
    grid = _grid_or_default()
    for name, given, own in (("mp_size", mp_size, grid.tensor), ("pp_size", pp_size, grid.pipe)):
        if given not in (None, own):
            raise ValueError(
                f"{name}={given} differs from the grid's {own}; the expert groups split the grid's data axis"
            )
    if mp_mode != "tp" or folding_spec is not None:
        raise NotImplementedError("mp_mode='sp' and folding_spec (AutoEP+AutoTP folding) are not available")
    grid.expert_groups(expert_parallel_size_, data_before_expert=use_data_before_expert_parallel_)


def _create_expert_data_and_model_parallel(expert_parallel_size_, mpu, use_data_before_expert_parallel_=False):
    """DeepSpeed's groups for experts split over the tensor group: the expert groups of
    ``expert_parallel_size_`` on the grid (collective), whose tensor size ``mpu``'s must be;
    afterwards :func:`_get_expert_model_parallel_world_size` is that size."""
    grid = _grid_or_default()
    tensor = 1 if mpu is None else int(mpu.get_tensor_model_parallel_world_size())
    if tensor != grid.tensor:
        raise ValueError(
            f"the mpu's tensor-parallel size {tensor} differs from the grid's {grid.tensor}; the expert "
            "groups split the grid's data axis"
        )
    grid.expert_groups(expert_parallel_size_, data_before_expert=use_data_before_expert_parallel_)
    _set_expert_tensor_parallel_size(tensor)


_expert_tensor_parallel_size = 1  # DeepSpeed's expert_tensor_parallel_world_size


def _set_expert_tensor_parallel_size(size: int) -> None:
    """Record that experts are split over tensor groups of ``size`` (called by
    ``MoE.bind`` when it splits its experts)."""
    global _expert_tensor_parallel_size
    _expert_tensor_parallel_size = size


def _expert_groups(group_name: str):
    groups = _grid_or_default().expert_group_dict
    if group_name not in groups:
        raise KeyError(
            f"no expert groups named {group_name!r} (built: {sorted(groups) or 'none'}); they are built by "
            "shardwise.initialize for the model's MoE layers"
        )
    return groups[group_name]


def _get_expert_parallel_group_dict() -> dict:
    return {name: g.ep_comm.group for name, g in _grid_or_default().expert_group_dict.items()}


def _get_expert_data_parallel_group_dict() -> dict:
    return {name: g.edp_comm.group for name, g in _grid_or_default().expert_group_dict.items()}


def _get_expert_parallel_group(group_name: str):
    return _expert_groups(group_name).ep_comm.group


def _get_expert_data_parallel_group(group_name: str):
    return _expert_groups(group_name).edp_comm.group


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert_groups(group_name).ep_ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert_groups(group_name).edp_ranks)


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert_groups(group_name).ep_size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert_groups(group_name).edp_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert_groups(group_name).ep_comm.rank


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert_groups(group_name).edp_comm.rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-parallel group."""
    return _expert_groups(group_name).ep_ranks[0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-data-parallel group."""
    return _expert_groups(group_name).edp_ranks[0]


def _get_max_expert_size() -> int:
    sizes = [g.ep_size for g in _grid_or_default().expert_group_dict.values()]
    return max(sizes) if sizes else 1


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """The tensor-parallel size the experts are split over (1: experts are whole)."""
    return _expert_tensor_parallel_size
