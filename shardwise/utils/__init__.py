"""DeepSpeed's ``deepspeed.utils`` names: logging helpers, ``RepeatingLoader``, the
process-group accessors (``groups``), per-parameter state access (``safe_get_full_*``),
ZeRO-3 leaf modules, checkpoint consolidation (``zero_to_fp32``) and the module-tree
helpers (``recursive_getattr`` / ``recursive_setattr``, ``OnDevice``).

The code lives where it belongs (``shardwise.zero``, ``shardwise.runtime.data``...);
this package only gathers the names where DeepSpeed users import them.
"""

from shardwise.runtime.data import RepeatingLoader
from shardwise.utils import groups, init_on_device, logging, module_utils, zero_to_fp32
from shardwise.utils._logging import log_dist, log_dist_once, logger, print_dist, set_log_level_from_string
from shardwise.utils._modules import OnDevice, recursive_getattr, recursive_setattr
from shardwise.zero import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from shardwise.zero._param_state import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)


def is_initialized() -> bool:
    """Whether torch.distributed has been started (``deepspeed.utils.is_initialized``)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "init_on_device",
    "is_initialized",
    "log_dist",
    "log_dist_once",
    "logger",
    "logging",
    "module_utils",
    "print_dist",
    "recursive_getattr",
    "recursive_setattr",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "set_log_level_from_string",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "zero_to_fp32",
]
