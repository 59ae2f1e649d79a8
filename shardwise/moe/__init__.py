"""DeepSpeed's ``deepspeed.moe``: the mixture-of-experts layer and its helpers.

``MoE`` (``layer.py``) routes each token to ``k`` of ``num_experts`` experts
(``_gating.py``) and moves only the routed tokens (``_dispatch.py``); with ``ep_size > 1``
the experts are split over ranks of the data-parallel group (the grid's expert groups,
``parallel/_expert.py``), and ``shardwise.initialize`` reduces expert gradients over the
ranks holding the same experts (see [Note: expert groups]); with
``enable_expert_tensor_parallelism`` each expert is split over the tensor group too (see
[Note: tensor-parallel experts] in ``_expert_tp.py``).
"""

from shardwise.moe import experts, layer, sharded_moe, utils
from shardwise.moe.layer import MoE

__all__ = ["MoE", "experts", "layer", "sharded_moe", "utils"]
