"""DeepSpeed's ``deepspeed.moe.sharded_moe`` names: the gate and the expert layer.

The routing rules are in ``_gating.py`` ([Note: routes, not dispatch masks]) and the
token movement in ``_dispatch.py`` ([Note: sorted dispatch]).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import Tensor, nn

from shardwise.moe import _expert_tp, _gating, _grouped
from shardwise.moe._dispatch import dispatch_combine, run_each
from shardwise.moe._grouped import GroupedExperts

logger = logging.getLogger("shardwise")

_NOISE_POLICIES = (None, "None", "Jitter", "RSample")


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """DeepSpeed's ``_capacity``: places per expert for ``gates`` [S, E]."""
    cap = _gating.capacity(gates.shape[0], gates.shape[1], float(capacity_factor), int(min_capacity))
    return torch.tensor(cap, dtype=torch.int64)


def multiplicative_jitter(x: Tensor, device=None, epsilon: float = 1e-2) -> Tensor:
    """``x`` times a uniform factor in ``[1 - epsilon, 1 + epsilon]`` per element."""
    del device
    return _gating.jitter(x, epsilon)


def gumbel_rsample(shape, device) -> Tensor:
    """Standard Gumbel samples of ``shape``."""
    return _gating.gumbel_noise(shape, device)


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
):
    """DeepSpeed's top-1 gate: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    _refuse_sparse_routes(sparse_routes)
    routes = _gating.top1(
        logits.float(),
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        used_token=used_token,
        noisy_gate_policy=noisy_gate_policy,
        drop_tokens=drop_tokens,
        use_rts=use_rts,
    )
    return routes.deepspeed_outputs(logits.shape[1])


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
):
    """DeepSpeed's top-2 gate: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    _refuse_sparse_routes(sparse_routes)
    routes = _gating.top2(
        logits.float(),
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        drop_tokens=drop_tokens,
        second_expert_sampling=top2_2nd_expert_sampling,
    )
    return routes.deepspeed_outputs(logits.shape[1])


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
):
    """DeepSpeed's top-k gate: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    _refuse_sparse_routes(sparse_routes)
    routes = _gating.topk(
        logits.float(),
        k,
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        drop_tokens=drop_tokens,
        drop_policy=drop_policy,
    )
    return routes.deepspeed_outputs(logits.shape[1])


def _refuse_sparse_routes(sparse_routes: bool) -> None:
    if sparse_routes:
        raise NotImplementedError(
            "sparse_routes=True is DeepSpeed-internal (its MOELayer's index form); use TopKGate.route() for "
            "shardwise's routes"
        )


class TopKGate(nn.Module):
    """DeepSpeed's gate: a bias-free linear ``wg`` from the model dimension to one logit
    per expert (computed in fp32), and the top-k rule of ``_gating.py``.

    ``forward`` returns DeepSpeed's ``(l_aux, combine_weights, dispatch_mask, exp_counts)``;
    :meth:`route` returns the routes the MoE layer uses."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        check_gate_args(num_experts, k, noisy_gate_policy)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Tensor | None = None) -> _gating.Routes:
        """The routes of tokens ``input`` [S, model_dim]."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = _gating.jitter(x)
        logits = nn.functional.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        common = {"capacity_factor": factor, "min_capacity": self.min_capacity, "drop_tokens": self.drop_tokens}
        if self.k == 1:
            return _gating.top1(
                logits,
                used_token=used_token,
                noisy_gate_policy=self.noisy_gate_policy if self.training else None,
                use_rts=self.use_rts,
                **common,
            )
        if self.k == 2:
            return _gating.top2(logits, second_expert_sampling=self.top2_2nd_expert_sampling, **common)
        return _gating.topk(logits, self.k, **common)

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False, use_tutel=False):
        _refuse_sparse_routes(sparse_routes)
        return self.route(input, used_token).deepspeed_outputs(self.num_experts)


def check_gate_args(num_experts: int, k: int, noisy_gate_policy) -> None:
    """Clear errors for a gate that cannot work."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k={k!r}: each token picks k of the {num_experts} experts; use 1 <= k <= num_experts")
    if noisy_gate_policy not in _NOISE_POLICIES:
        raise ValueError(
            f"unknown noisy_gate_policy={noisy_gate_policy!r}; use None, 'Jitter' (multiplies the gate "
            "input by noise) or 'RSample' (Gumbel noise on the top-1 choice)"
        )


class MOELayer(nn.Module):
    """DeepSpeed's expert layer: ``gate`` routes the tokens, ``experts`` (this rank's
    ``num_local_experts`` of ``ep_size * num_local_experts``) compute them.

    ``forward(x, used_token=None)`` returns the output in ``x``'s shape and sets
    ``l_aux`` and ``exp_counts``. With ``ep_size > 1`` the layer needs its expert-parallel
    group (set by ``shardwise.initialize`` or ``MoE.set_deepspeed_parallelism``)."""

    def __init__(
        self, gate: nn.Module, experts: nn.Module, ep_group_name, ep_size, num_local_experts: int, use_tutel=False
    ):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_comm = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.l_aux = None
        self.exp_counts = None
        self.tensor_comm = None
        """The tensor group's Communicator when the experts are split over it (see [Note:
        tensor-parallel experts] in ``_expert_tp.py``); None: whole experts."""
        self.tensor_token_shares = True
        """With experts split over the tensor group: each tensor rank moves only its share of
        the tokens through the all-to-all (DeepSpeed's ``drop_tokens``); False: every rank
        moves them all. ``MoE.bind`` sets it to whether the all-to-all crosses hosts."""
        self.wall_clock_breakdown = False
        self.use_tutel = False
        self.use_grouped_mm = True
        """In bf16 on a GPU, run the local experts with one grouped matmul per linear layer
        where they qualify (see [Note: grouped experts]); False runs each expert module on
        its rows."""
        self._grouped: tuple[tuple[int, ...], GroupedExperts | None] = ((), None)
        if use_tutel:
            logger.warning(
                "use_tutel=True: shardwise's MoE dispatch moves only the routed tokens (no capacity "
                "padding to optimize away); Tutel is not used"
            )

    def _run_local(self, rows: Tensor, counts: list[int]) -> Tensor:
        experts = list(self.experts.deepspeed_experts)
        grouped = None
        if self.use_grouped_mm and (rows.device.type, rows.dtype) in _grouped.FAST_ON:
            grouped = self._grouped_plan(experts)
        if grouped is not None and grouped.usable(rows):
            return grouped(rows, counts)
        return run_each(experts, rows, counts)

    def _grouped_plan(self, experts: list[nn.Module]) -> GroupedExperts | None:
        key = tuple(map(id, experts))
        if self._grouped[0] != key:
            self._grouped = (key, GroupedExperts.plan(experts))
        return self._grouped[1]

    def _shares_tokens(self) -> bool:
        return self.tensor_comm is not None and self.tensor_token_shares

    def _set_ep_group(self, ep_group) -> None:
        """Use ``ep_group`` (a Communicator, or a process group) for the token exchange."""
        from shardwise.comm import Communicator

        if ep_group is not None and not isinstance(ep_group, Communicator):
            ep_group = Communicator(ep_group, name=f"expert-parallel ({self.ep_group_name})")
        self.ep_comm = ep_group
        self.ep_group = None if ep_group is None else ep_group.group
        self.gate._set_ep_group(self.ep_group)

    def forward(self, *input: Tensor, **kwargs) -> Tensor:
        x = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        if self.ep_size > 1 and self.ep_comm is None:
            raise RuntimeError(
                f"this MoE layer splits its experts over ep_size={self.ep_size} ranks but has no "
                "expert-parallel group: build the engine with shardwise.initialize() (or call "
                "MoE.set_deepspeed_parallelism() after torch.distributed is started) before the forward"
            )
        tokens = x.reshape(-1, x.shape[-1])
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        out = dispatch_combine(
            tokens,
            routes,
            self._run_local,
            num_experts=self.ep_size * self.num_local_experts,
            ep_comm=self.ep_comm if self.ep_size > 1 else None,
            tag=f"moe ({self.ep_group_name})",
            remote=partial(_expert_tp.remote_experts, tensor=self.tensor_comm) if self._shares_tokens() else None,
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])
