"""DeepSpeed's ``MoE`` layer: a gate, ``num_experts`` experts split over ``ep_size`` ranks."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from shardwise.moe.experts import Experts
from shardwise.moe.sharded_moe import MOELayer, TopKGate, check_gate_args


class MoE(nn.Module):
    """A mixture-of-experts layer with DeepSpeed's arguments, defaults and names.

    Args:
        hidden_size: the input and output dimension.
        expert: the expert module (tokens ``[n, hidden_size]`` in, same out); each rank
            holds ``num_experts // ep_size`` deep copies of it.
        num_experts: experts in the layer.
        ep_size: ranks the experts are split over (must divide the data-parallel size).
        k: experts per token (1, 2, or more).
        capacity_factor, eval_capacity_factor: an expert takes at most
            ``ceil(tokens / num_experts * factor * k)`` of a rank's tokens in training /
            evaluation, and at least ``min_capacity``.
        use_residual: PR-MoE's residual MLP: the output mixes the experts' with ``expert``'s
            own (a dense copy), by a learned two-way softmax.
        noisy_gate_policy: None, 'Jitter' or 'RSample'.
        drop_tokens: False routes every token (dropless; nothing is padded either way).
        use_rts: random token selection when an expert is over capacity (top-1).
        use_tutel: accepted; shardwise's dispatch does not pad, Tutel is not used.
        enable_expert_tensor_parallelism: with a tensor-parallel grid (``initialize(...,
            mpu=grid)``), split each local expert over the tensor group: its first linear
            layer(s) column-parallel, its last row-parallel (see [Note: tensor-parallel
            experts] in ``_expert_tp.py``). Without one (tensor size 1) it changes nothing,
            as in DeepSpeed.
        top2_2nd_expert_sampling: Gumbel noise on the second choice of the top-2 gate.

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``.
    Parameter names are DeepSpeed's: ``deepspeed_moe.gate.wg.weight`` and the local experts
    under ``deepspeed_moe.experts.deepspeed_experts.<i>`` (local expert ``i`` of expert
    rank ``r`` is global expert ``r * num_local_experts + i``).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        check_gate_args(num_experts, k, noisy_gate_policy)
        if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each of the ep_size "
                "ranks holds num_experts / ep_size experts; pick an ep_size dividing num_experts"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts, use_tutel=use_tutel
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Give the layer its expert-parallel group from the process grid of the engine
        built last (a data-parallel grid over the world when there is none).
        ``shardwise.initialize`` does this for every MoE layer of the model."""
        from shardwise.utils import groups

        grid = groups._grid_or_default()
        groups_ = grid.expert_groups(self.ep_size, data_before_expert=use_data_before_expert_parallel_)
        self.bind(groups_, grid.tensor_comm if grid.tensor > 1 else None)

    def bind(self, expert_groups, tensor_comm=None) -> dict[nn.Parameter, nn.Parameter]:
        """Use ``expert_groups`` (:class:`~shardwise.parallel.ExpertGroups` of this layer's
        ep_size). With ``enable_expert_tensor_parallelism`` and ``tensor_comm`` (the tensor
        group's Communicator), split each local expert over it; returns the replaced
        parameters (old -> new), which an optimizer built before must be pointed at."""
        self.deepspeed_moe._set_ep_group(expert_groups.ep_comm)
        self.expert_groups = expert_groups
        if not self.enable_expert_tensor_parallelism or tensor_comm is None or tensor_comm.world_size == 1:
            return {}
        from shardwise.moe._expert_tp import crosses_hosts, split_expert
        from shardwise.utils import groups

        replaced = {}
        for i, expert in enumerate(self.deepspeed_moe.experts.deepspeed_experts):
            where = f"MoE expert {type(expert).__name__} (local expert {i})"
            replaced.update(split_expert(expert, tensor_comm, where=where))
        self.deepspeed_moe.tensor_comm = tensor_comm
        self.deepspeed_moe.tensor_token_shares = crosses_hosts(expert_groups.ep_comm, tensor_comm)
        groups._set_expert_tensor_parallel_size(tensor_comm.world_size)
        return replaced

    def global_expert_ids(self) -> list[int]:
        """The global ids of this rank's experts, in local order."""
        rank = self.deepspeed_moe.ep_comm.rank if self.deepspeed_moe.ep_comm is not None else 0
        return [rank * self.num_local_experts + i for i in range(self.num_local_experts)]

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
