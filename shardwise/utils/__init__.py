"""DeepSpeed's ``deepspeed.utils`` names: logging helpers, ``RepeatingLoader``, the
process-group accessors (``groups``), per-parameter state access (``safe_get_full_*``),
ZeRO-3 leaf modules and checkpoint consolidation (``zero_to_fp32``).

The code lives where it belongs (``shardwise.zero``, ``shardwise.runtime.data``...);
this package only gathers the names where DeepSpeed users import them.
"""

from shardwise.runtime.data import RepeatingLoader
from shardwise.utils import groups, zero_to_fp32
from shardwise.utils._logging import log_dist, log_dist_once, logger, print_dist, set_log_level_from_string
from shardwise.zero import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules,
                            z3_leaf_module)
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


__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "groups", "is_initialized", "log_dist", "log_dist_once",
           "logger", "print_dist", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state", "set_log_level_from_string", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "z3_leaf_module", "zero_to_fp32"]
