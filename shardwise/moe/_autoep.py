"""DeepSpeed's ``"expert_parallel"`` config section (AutoEP): Hugging Face MoE models with
their experts split over ranks.

[Note: expert parallelism for Hugging Face models]
transformers keeps a sparse MoE block's experts as one module of stacked weights
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; Mixtral, Qwen2-MoE, Qwen3-MoE...)
called as ``experts(hidden_states, top_k_index, top_k_weights)`` after the block's own
router. AutoEP keeps the router and the expert math of the model and changes only where
the experts run: each experts module keeps rows ``r * E_local .. (r + 1) * E_local - 1``
of every stacked weight on expert rank ``r`` (same attribute names: the module's class is
swapped for a subclass, as FSDP2's ``fully_shard`` does), and its forward moves the routed
tokens to the rank holding their expert and back (``_dispatch.py``), calling the model's
own experts forward on the rows that arrive, as if the block had ``E_local`` experts and
each row picked one with weight 1. The sliced weights are expert parameters of group
``ep_size_<n>`` (reduced over their expert-data-parallel group, see [Note: expert groups]).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shardwise.config._expert_parallel import PRESETS, check_expert_parallel
from shardwise.moe._bind import refuse_unsupported
from shardwise.moe._dispatch import dispatch_combine
from shardwise.moe._gating import Routes


class ExpertParallel:
    """Mixed into a Hugging Face experts module's class (see [Note: expert parallelism for
    Hugging Face models]); ``ep_comm`` and ``global_num_experts`` are set by :func:`split`."""

    ep_comm = None
    global_num_experts = 0
    replicated_tokens = False
    """Every rank has every token (inference): see [Note: experts at inference] in
    ``inference/engine.py``."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        expert = top_k_index.long()
        kept = expert >= 0
        if self.replicated_tokens:
            return self._local_share(hidden_states, expert, kept, top_k_weights)
        routes = Routes.given(expert.clamp_min(0), top_k_weights, kept, self.global_num_experts)
        return dispatch_combine(
            hidden_states,
            routes,
            self._run_local,
            num_experts=self.global_num_experts,
            ep_comm=self.ep_comm,
            tag="autoep",
        )

    def _run_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The model's own experts forward on ``rows`` grouped by local expert, weight 1 each."""
        ids = torch.repeat_interleave(
            torch.arange(len(counts), device=rows.device), torch.tensor(counts, device=rows.device)
        )
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return super().forward(rows, ids.unsqueeze(1), ones)

    def _local_share(self, hidden_states, expert, kept, top_k_weights) -> torch.Tensor:
        """This rank's experts' share of every token's output, summed over the ranks."""
        low = self.ep_comm.rank * self.num_experts
        mine = kept & (expert >= low) & (expert < low + self.num_experts)
        routes = Routes.given((expert - low).clamp(0, self.num_experts - 1), top_k_weights, mine, self.num_experts)
        out = dispatch_combine(hidden_states, routes, self._run_local, num_experts=self.num_experts)
        self.ep_comm.all_reduce(out, tag="expert outputs").wait()
        return out


def stacked_names(module: nn.Module, num_experts: int) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts]


def find_experts(model: nn.Module, values: dict) -> list[tuple[str, nn.Module]]:
    """The experts modules AutoEP splits: children named ``experts`` of MoE blocks (the
    preset's class, or any block) with stacked weights, filtered by the patterns."""
    block_class = PRESETS.get(values["preset_model"])
    layer_re = re.compile(values["moe_layer_pattern"]) if values["moe_layer_pattern"] else None
    expert_re = re.compile(values["expert_pattern"]) if values["expert_pattern"] else None
    found = []
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or isinstance(experts, nn.ModuleList):
            continue
        if block_class is not None and type(block).__name__ != block_class:
            continue
        if layer_re is not None and not layer_re.search(name):
            continue
        full = f"{name}.experts" if name else "experts"
        if expert_re is not None and not expert_re.search(full):
            continue
        num = getattr(experts, "num_experts", None)
        if isinstance(num, int) and stacked_names(experts, num):
            found.append((full, experts))
    return found


def split(experts: nn.Module, groups) -> dict:
    """Keep this rank's rows of ``experts``' stacked weights and make its forward expert
    parallel (in place); returns old parameter -> new."""
    total, ep = experts.num_experts, groups.ep_size
    if total % ep:
        raise ValueError(
            f"{type(experts).__name__} has {total} experts, not divisible by expert_parallel.autoep_size={ep}; "
            "use an autoep_size dividing the number of experts"
        )
    local = total // ep
    low = groups.ep_rank * local
    replaced = {}
    for name in stacked_names(experts, total):
        old = experts._parameters[name]
        new = nn.Parameter(old.detach()[low : low + local].clone(), requires_grad=old.requires_grad)
        new.allreduce, new.group_name = False, groups.name
        experts._parameters[name] = new
        replaced[old] = new
    cls = type(experts)
    experts.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    experts.num_experts = local
    experts.global_num_experts = total
    experts.ep_comm = groups.ep_comm
    experts.expert_groups = groups
    return replaced


def apply_autoep(model: nn.Module, grid, config, *, pipeline: bool = False) -> dict:
    """Split the experts of ``model``'s MoE blocks as ``config``'s ``expert_parallel``
    section asks (collective: builds the expert groups); returns old parameter -> new."""
    section = config.raw.get("expert_parallel")
    if not section:
        return {}
    values = check_expert_parallel(section)
    if not values["enabled"]:
        return {}
    found = find_experts(model, values)
    if not found:
        raise ValueError(
            "expert_parallel.enabled: the model has no MoE block with stacked experts (a child 'experts' with "
            "weights [num_experts, ...], as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE have); check "
            "preset_model / moe_layer_pattern / expert_pattern, or build the model with shardwise.moe.layer.MoE"
        )
    refuse_unsupported(config, pipeline=pipeline, what="expert_parallel (AutoEP)")
    data_before_expert = bool(config.raw.get("use_data_before_expert_parallelism", False))
    groups = grid.expert_groups(values["autoep_size"], data_before_expert=data_before_expert)
    replaced = {}
    for _, experts in found:
        replaced.update(split(experts, groups))
    return replaced


def split_for_inference(model: nn.Module, ep_size: int, *, tp: int = 1) -> None:
    """Split the experts of ``model`` over ``ep_size`` ranks for ``init_inference`` (see
    [Note: experts at inference] in ``inference/engine.py``; collective)."""
    import torch.distributed as dist

    from shardwise.comm import init_distributed
    from shardwise.moe.layer import MoE
    from shardwise.parallel import ParallelGrid

    if not dist.is_initialized():
        init_distributed()
    grid = ParallelGrid.build(tensor=tp)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    found = find_experts(model, check_expert_parallel({}))
    if not layers and not found:
        raise ValueError(
            f"moe.ep_size={ep_size}: the model has no MoE block with stacked experts (transformers' Mixtral, "
            "Qwen2-MoE, Qwen3-MoE...) and no shardwise.moe.layer.MoE layer to split"
        )
    for size in sorted({layer.ep_size for layer in layers}):
        grid.expert_groups(size)
    for layer in layers:
        layer.bind(grid.expert_groups(layer.ep_size))
    if found:
        groups = grid.expert_groups(ep_size)
        with torch.no_grad():
            for _, experts in found:
                split(experts, groups)
                experts.replicated_tokens = True
