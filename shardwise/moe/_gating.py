"""Routing tokens to experts: DeepSpeed's top-1, top-2 and top-k gates as routes.

[Note: routes, not dispatch masks]
A gate decides, for each of a rank's ``S`` tokens, ``k`` experts (``Routes.expert``), the
weight each chosen expert's output gets (``Routes.weight``) and whether the route is kept
(``Routes.kept``) or dropped by the expert's capacity. DeepSpeed builds dense
``[S, E, C]`` combine and dispatch tensors from the same decisions; shardwise keeps the
routes and moves only the kept tokens (``_dispatch.py``), so a capacity costs no padding.
``Routes.slot`` is the place of each kept route in DeepSpeed's ``[E, C]`` expert buffer,
used only to build those dense tensors for callers of ``TopKGate.forward``.

The rules are DeepSpeed's (per rank, on the rank's own tokens):
- capacity ``C = max(ceil(S / E * capacity_factor * k), min_capacity)`` (``k`` is 1 for
  the top-1 gate); with ``drop_tokens=False`` nothing is dropped.
- top-1: the expert of the largest probability (of logits plus Gumbel noise under
  ``noisy_gate_policy="RSample"`` in training). Over capacity, ``use_rts`` keeps a random
  ``C`` of an expert's tokens, otherwise its first ``C`` in token order. The weight is
  the chosen probability. ``used_token`` (0/1 per token) takes tokens out of routing.
  ``l_aux = E * sum(mean_prob * fraction_routed)``.
- top-2: first choice by probability, second by logits (plus Gumbel noise when
  ``top2_2nd_expert_sampling``) among the rest; every expert's first choices take its
  first places, then its second choices; a route past ``2 * ...`` capacity is dropped;
  the kept routes' probabilities are renormalized to sum to one.
  ``l_aux = E * E * mean(mean_prob * fraction_first_routed)``.
- top-k (k > 2): the ``k`` most probable experts; over capacity an expert keeps its most
  probable tokens; weights renormalized over the kept routes;
  ``l_aux = E * E / k * mean(mean_prob * fraction_routed)``.
``exp_counts`` counts every route before capacity drops (DeepSpeed's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routes:
    """One gate decision for ``S`` tokens (see [Note: routes, not dispatch masks])."""

    expert: torch.Tensor
    """[S, k] int64 expert of each route."""
    weight: torch.Tensor
    """[S, k] fp32 combine weight (0 for a dropped route)."""
    kept: torch.Tensor
    """[S, k] bool."""
    slot: torch.Tensor
    """[S, k] int64 place in DeepSpeed's [E, C] buffer (meaningful where kept)."""
    capacity: int
    """Places per expert in DeepSpeed's buffer (the largest count when nothing drops)."""
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    """[E] int64 routes per expert before drops."""

    @classmethod
    def given(cls, expert: torch.Tensor, weight: torch.Tensor, kept: torch.Tensor, num_experts: int) -> Routes:
        """Routes a model's own router chose (AutoEP): no capacity, nothing counted."""
        return cls(
            expert,
            weight.float() * kept,
            kept,
            torch.zeros_like(expert),
            0,
            torch.zeros(()),
            torch.zeros(num_experts, dtype=torch.long),
        )

    def deepspeed_outputs(self, num_experts: int) -> tuple:
        """DeepSpeed's gate outputs ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        return (self.l_aux, *self.dense(num_experts), self.exp_counts)

    def dense(self, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's ``(combine_weights [S, E, C], dispatch_mask)``."""
        s, k = self.expert.shape
        combine = torch.zeros(s, num_experts, self.capacity, dtype=torch.float32, device=self.weight.device)
        tokens = torch.arange(s, device=self.expert.device).unsqueeze(1).expand(s, k)
        keep = self.kept & (self.weight != 0)
        combine[tokens[keep], self.expert[keep], self.slot[keep]] = self.weight[keep]
        return combine, combine.bool()


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's expert capacity for ``num_tokens`` tokens."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), int(min_capacity))


def _uniform_like(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32).uniform_(low, high)


def gumbel_noise(shape, device) -> torch.Tensor:
    """Standard Gumbel samples."""
    u = torch.rand(shape, device=device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """``x`` times a uniform factor in ``[1 - epsilon, 1 + epsilon]`` per element."""
    if epsilon == 0:
        return x
    return x * _uniform_like(x, 1.0 - epsilon, 1.0 + epsilon)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Place of each routed token among its expert's routed tokens, in token order.
    (Scanned along a contiguous last dimension: a GPU scans ``[S, E]`` down its few
    columns one column per thread block, 5.8 ms for 32768 tokens and 8 experts on an
    H100, against microseconds this way.)"""
    return torch.cumsum(mask.t().contiguous(), dim=1).t() - 1


def _dropless_capacity(counts: torch.Tensor) -> int:
    return int(counts.max()) if counts.numel() else 0


def top1(
    logits: torch.Tensor,
    *,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Routes:
    """DeepSpeed's top-1 gate on fp32 ``logits`` [S, E]."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = logits + gumbel_noise(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    index = torch.argmax(chooser, dim=1)
    mask = F.one_hot(index, e)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(0).detach()
    l_aux = torch.sum(gates.mean(0) * mask.float().mean(0)) * e
    cap = capacity(s, e, capacity_factor, min_capacity) if drop_tokens else _dropless_capacity(exp_counts)
    if drop_tokens:
        if use_rts:  # a random ``cap`` of each expert's tokens
            priority = mask * torch.rand(mask.shape, device=mask.device)
            chosen = torch.topk(priority, k=min(cap, s), dim=0).indices
            mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
        else:
            mask = mask * (_positions(mask) < cap)
    kept = mask.sum(1) > 0
    slot = (_positions(mask) * mask).sum(1)
    weight = gates.gather(1, index.unsqueeze(1)).squeeze(1) * kept
    return Routes(index.unsqueeze(1), weight.unsqueeze(1), kept.unsqueeze(1), slot.unsqueeze(1), cap, l_aux, exp_counts)


def top2(
    logits: torch.Tensor,
    *,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
) -> Routes:
    """DeepSpeed's top-2 gate on fp32 ``logits`` [S, E]."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, e)
    noisy = logits + gumbel_noise(logits.shape, logits.device) if second_expert_sampling else logits
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, e)
    place1 = _positions(mask1)
    place2 = _positions(mask2) + mask1.sum(0, keepdim=True)
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * e * e
    exp_counts = (mask1 + mask2).sum(0).detach()
    if drop_tokens:
        cap = capacity(s, e, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (place1 < cap)
        mask2 = mask2 * (place2 < cap)
    else:
        cap = _dropless_capacity(exp_counts)
    kept = torch.stack([mask1.sum(1) > 0, mask2.sum(1) > 0], dim=1)
    slot = torch.stack([(place1 * mask1).sum(1), (place2 * mask2).sum(1)], dim=1)
    expert = torch.stack([first, second], dim=1)
    chosen = gates.gather(1, expert) * kept
    weight = chosen / chosen.sum(1, keepdim=True).clamp_min(torch.finfo(chosen.dtype).eps)
    return Routes(expert, weight, kept, slot, cap, l_aux, exp_counts)


def topk(
    logits: torch.Tensor,
    k: int,
    *,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> Routes:
    """DeepSpeed's top-k gate (k > 2) on fp32 ``logits`` [S, E]; over capacity an expert
    keeps its most probable tokens (``drop_policy="probs"``) or its first ones ("position")."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy={drop_policy!r}: use 'probs' or 'position'")
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, expert = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, expert, True)
    exp_counts = mask.sum(0).detach()
    l_aux = torch.mean(gates.mean(0) * mask.float().mean(0)) * e * e / k
    if drop_tokens and drop_policy == "position":
        cap = capacity(s, e, capacity_factor * k, min_capacity)
        mask &= _positions(mask.long()) < cap
    elif drop_tokens:  # each expert keeps its most probable tokens
        cap = capacity(s, e, capacity_factor * k, min_capacity)
        masked = torch.zeros_like(gates).scatter(1, expert, top_gate)
        best = torch.topk(masked, k=min(cap, s), dim=0, sorted=False).indices
        mask &= torch.zeros_like(mask).scatter_(0, best, True)
    else:
        cap = _dropless_capacity(exp_counts)
    places = _positions(mask.long())
    kept = mask.gather(1, expert)
    slot = places.gather(1, expert)
    chosen = top_gate * kept
    weight = chosen / chosen.sum(1, keepdim=True).clamp_min(torch.finfo(chosen.dtype).eps)
    return Routes(expert, weight, kept, slot, cap, l_aux, exp_counts)
