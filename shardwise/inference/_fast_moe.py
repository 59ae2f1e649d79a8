"""The fast decoder of Hugging Face MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE): the
Llama decoder's attention ([Note: the fast decoder]) and a MoE MLP over the model's
stacked experts.

[Note: the fast MoE MLP]
A sparse MoE block routes each token to ``top_k`` of its experts and sums their outputs,
weighted by the router. The decoder runs the block's arithmetic on its own weights:

- routing is a pure function of the router's logits and the family's rule (``Routing``:
  softmax in float32, top-k, renormalized to sum 1 where the family does so, the weights
  kept in float32 or cast back), as the Hugging Face router computes it;
- the experts' stacked weights (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
  are re-stored input-major once (``[E, H, 2I]``, ``[E, I, H]``; the module's parameters
  become transposed views, see [Note: input-major weights]);
- with few tokens per step there are two ways to run them. Sorting the token-expert pairs
  by expert and running each expert on its rows reads only the chosen experts' weights,
  but its slices need the counts on the host (a sync). Running every local expert on
  every token (two batched matmuls) and weighting by a dense ``[tokens, E]`` routing
  matrix (zero for the experts not chosen) needs no sync, so a CUDA graph can capture it
  ([Note: decode graphs]), at ``E / top_k`` times the arithmetic. On the CPU, hidden 256,
  intermediate 512, 8 experts, top-2, one thread, one MoE MLP: sorted 0.22 / 0.58 / 0.87
  ms for 1 / 8 / 32 tokens against every expert 0.56 / 0.72 / 1.6 ms. The decoder sorts,
  except in decode steps (one token per row) on a GPU (``sync_free``), and a single token
  runs its experts one after another with no sort (0.20 against 0.26 ms in the decoder,
  0.11 ms of it the matmuls);
- under expert parallelism ([Note: experts at inference] in ``engine.py``) each rank
  holds rows ``rank * E_local ..`` of the stacked weights, runs its experts' share of
  every token (pairs routed elsewhere get no rows, or a zero weight) and one all-reduce
  over the expert-parallel group sums the shares. A shared expert (Qwen2-MoE, gated by a
  sigmoid) is held whole on every rank and added after the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.inference._fast import GatedMLP, LlamaDecoder, _NoFastPath, fused_proj, proj

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True, kw_only=True)
class Routing:
    """How a family's router turns logits into each token's experts and weights."""

    top_k: int
    """Experts per token."""
    renormalize: bool
    """Divide the chosen probabilities by their sum (Mixtral always; Qwen's ``norm_topk_prob``)."""
    float32_weights: bool
    """Keep the weights in float32 (Mixtral) instead of casting them to the logits' dtype (Qwen)."""


def routing_of(config) -> Routing:
    """The routing rule of a Hugging Face MoE config (``MODEL_TYPES``)."""
    if config.model_type == "mixtral":
        return Routing(top_k=config.num_experts_per_tok, renormalize=True, float32_weights=True)
    return Routing(top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob), float32_weights=False)


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, both ``[tokens, top_k]``, of router ``logits`` ``[tokens, E]``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if routing.float32_weights else weights.to(logits.dtype)), experts


def _input_major_experts(experts: nn.Module, name: str) -> torch.Tensor:
    """``experts.<name>`` (``[E, out, in]``) re-stored as ``[E, in, out]``; the parameter
    becomes the transposed view, so the model's own forward reads the same memory."""
    old = experts._parameters[name]
    if old.stride(-2) == 1:  # stored input-major already (a decoder built before)
        return old.detach().transpose(1, 2)
    stored = old.detach().transpose(1, 2).contiguous()
    new = nn.Parameter(stored.transpose(1, 2), requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)  # expert-parallel and tensor-parallel marks
    experts._parameters[name] = new
    return stored


class MoEMLP:
    """One sparse MoE block of the fast decoder (see [Note: the fast MoE MLP]); with
    ``sync_free`` its decode steps run every expert (no host sync: a CUDA graph captures
    them)."""

    def __init__(self, block: nn.Module, routing: Routing, *, sync_free: bool) -> None:
        experts = block.experts
        self.routing, self.sync_free = routing, sync_free
        self.router = block.gate.weight
        self.gate_up = _input_major_experts(experts, "gate_up_proj")
        self.down = _input_major_experts(experts, "down_proj")
        self.act = experts.act_fn
        self.num_local = experts.num_experts
        self.ep_comm = experts.ep_comm if getattr(experts, "replicated_tokens", False) else None
        self.low = self.ep_comm.rank * self.num_local if self.ep_comm is not None else 0
        self.shared = None
        if getattr(block, "shared_expert", None) is not None:  # Qwen2-MoE
            shared = block.shared_expert
            fused, widths = fused_proj([shared.gate_proj, shared.up_proj, block.shared_expert_gate])
            self.shared = (fused, widths, proj(shared.down_proj), shared.act_fn)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        weights, experts = route(F.linear(flat, self.router), self.routing)
        local = experts - self.low
        mine = (local >= 0) & (local < self.num_local)
        local = torch.where(mine, local, self.num_local)  # pairs of other ranks' experts: one bin past the last
        if self.sync_free and s == 1:
            run = self._every_expert
        else:
            run = self._one_token if flat.shape[0] == 1 else self._sorted
        out = run(flat, weights, local)
        if self.ep_comm is not None:
            self.ep_comm.all_reduce(out, tag="inference expert outputs").wait()
        if self.shared is not None:
            fused, widths, down, act = self.shared
            g, u, gate = fused(flat).split(widths, dim=-1)
            out = out + torch.sigmoid(gate) * down(act(g) * u)
        return out.view(b, s, h)

    def _expert(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        g, u = (rows @ self.gate_up[e]).chunk(2, dim=-1)
        return (self.act(g) * u) @ self.down[e]

    def _one_token(self, flat: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """One token's local experts one after another (one host sync for their ids)."""
        out = torch.zeros_like(flat)
        for j, e in enumerate(local[0].tolist()):
            if e < self.num_local:
                out = out + (self._expert(flat, e) * weights[:, j, None]).to(flat.dtype)
        return out

    def _sorted(self, flat: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each local expert on the rows routed to it (one host sync for the counts)."""
        pairs = local.reshape(-1)
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=self.num_local + 1).tolist()[: self.num_local]
        order = order[: sum(counts)]
        token = order // local.shape[1]
        rows = flat[token]
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                outs.append(self._expert(rows[start : start + count], e))
                start += count
        y = torch.cat(outs) if outs else rows
        y = (y * weights.reshape(-1)[order, None]).to(flat.dtype)
        return torch.zeros_like(flat).index_add_(0, token, y)

    def _every_expert(self, flat: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, weighted by a dense routing matrix (no sync)."""
        dense = torch.zeros(flat.shape[0], self.num_local + 1, dtype=weights.dtype, device=flat.device)
        dense = dense.scatter_(1, local, weights)[:, : self.num_local]
        g, u = torch.matmul(flat, self.gate_up).chunk(2, dim=-1)  # [E, tokens, 2I]
        y = torch.bmm(self.act(g) * u, self.down)  # [E, tokens, H]
        return (y * dense.t()[:, :, None]).to(flat.dtype).sum(0)


class MoEDecoder(LlamaDecoder):
    """Mixtral, Qwen2-MoE, Qwen3-MoE: the Llama decoder with MoE MLPs (dense MLPs in the
    layers a Qwen config leaves dense)."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        if config.model_type == "qwen2_moe" and len(set(getattr(config, "layer_types", None) or ())) > 1:
            raise _NoFastPath("Qwen2-MoE with sliding-window attention in some layers only (use_sliding_window)")
        self.routing = routing_of(config)
        super().__init__(model)

    def _mlp(self, mlp: nn.Module):
        experts = getattr(mlp, "experts", None)
        if experts is None:
            return GatedMLP(mlp)
        if getattr(experts, "global_num_experts", 0) > experts.num_experts and not experts.replicated_tokens:
            raise _NoFastPath("MoE experts split for training (AutoEP: tokens move by all-to-all); use moe.ep_size")
        width = experts.gate_up_proj.shape[-2]
        if width != 2 * experts.intermediate_dim:
            raise _NoFastPath(
                f"MoE experts split over the tensor group (gate_up_proj has {width} rows, the config "
                f"{2 * experts.intermediate_dim})"
            )
        return MoEMLP(mlp, self.routing, sync_free=self.device.type == "cuda")
