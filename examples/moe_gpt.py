"""A small mixture-of-experts GPT: ``gpt_model.GPT`` with the MLP of some blocks replaced by
an ``MoE`` layer of MLP experts.

The MoE class is an argument (``shardwise.moe.layer.MoE`` or ``deepspeed.moe.layer.MoE``: the
same arguments, return values and parameter names), so the demo (``train_moe.py``) and the
benchmark (``bench/bench_moe.py``) build the same model under either library. Every weight
outside the experts is ``GPT``'s initialization from the torch seed; each expert is
initialized from a generator seeded by its *global* id, so expert ``e`` starts from the same
weights whatever ``ep_size`` and whichever rank holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gpt_model import GPT, GPTConfig
from torch import nn


@dataclass(frozen=True)
class MoESettings:
    """The MoE layers of the model (DeepSpeed's ``MoE`` arguments, plus where and how much)."""

    num_experts: int = 8
    k: int = 2
    ep_size: int = 2
    capacity_factor: float = 1.25
    min_capacity: int = 4
    drop_tokens: bool = True
    """False: dropless (every route kept)."""
    second_expert_sampling: bool = True
    """``top2_2nd_expert_sampling``: Gumbel noise on the second choice of the top-2 gate."""
    every: int = 2
    """An MoE MLP in every ``every``-th block (the 2nd, 4th, ...); 1: in every block."""
    aux_coef: float = 0.01
    """Weight of the load-balancing loss ``l_aux`` (summed over the MoE layers) in the loss."""


class ExpertMLP(nn.Module):
    """The 4x GELU MLP of ``gpt_model.Block``: one expert."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class MoEBlock(nn.Module):
    """``gpt_model.Block``'s attention, then an MoE layer where the block has its MLP.

    ``forward(x)`` returns ``(x, l_aux, exp_counts)``."""

    def __init__(self, config: GPTConfig, moe: MoESettings, moe_class):
        super().__init__()
        self.num_heads = config.num_heads
        self.ln1 = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.ln2 = nn.LayerNorm(config.width)
        self.moe = moe_class(
            hidden_size=config.width,
            expert=ExpertMLP(config.width),
            num_experts=moe.num_experts,
            ep_size=moe.ep_size,
            k=moe.k,
            capacity_factor=moe.capacity_factor,
            eval_capacity_factor=moe.capacity_factor,
            min_capacity=moe.min_capacity,
            drop_tokens=moe.drop_tokens,
            top2_2nd_expert_sampling=moe.second_expert_sampling,
        )

    def forward(self, x: torch.Tensor):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        out, l_aux, exp_counts = self.moe(self.ln2(x))
        return x + out, l_aux, exp_counts


class MoEGPT(GPT):
    """``GPT`` whose every ``moe.every``-th block is a :class:`MoEBlock`.

    ``expert_rank`` is this rank's place in its expert-parallel group (``rank % ep_size``
    in DeepSpeed's layout): it holds global experts ``expert_rank * E_local ..``.
    ``forward(idx, targets)`` returns the cross-entropy plus ``aux_coef`` times the summed
    ``l_aux``; the per-layer ``exp_counts`` of the last forward are in ``exp_counts``."""

    def __init__(self, config: GPTConfig, moe: MoESettings, moe_class, *, expert_rank: int = 0, seed: int = 0):
        super().__init__(config)
        self.moe_settings = moe
        self.exp_counts: list[torch.Tensor] = []
        for i in range(moe.every - 1, config.num_layers, moe.every):
            block = MoEBlock(config, moe, moe_class)
            for module in block.modules():
                self._init(module, config, residual=module is block.proj)
            self._init_experts(block.moe, i, expert_rank, seed)
            self.blocks[i] = block

    def _init_experts(self, layer: nn.Module, index: int, expert_rank: int, seed: int) -> None:
        local = layer.num_local_experts
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index * 1009 + expert_rank * local + i)
            with torch.no_grad():
                for linear, std in ((expert.fc, 0.02), (expert.out, 0.02 / math.sqrt(2 * self.config.num_layers))):
                    linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)
                    linear.bias.zero_()

    def moe_layers(self) -> list[nn.Module]:
        """The MoE layers, in block order."""
        return [block.moe for block in self.blocks if isinstance(block, MoEBlock)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        aux, counts = x.new_zeros(()), []
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                x, l_aux, exp_counts = block(x)
                aux = aux + l_aux
                counts.append(exp_counts)
            else:
                x = block(x)
        self.exp_counts = counts
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return loss + self.moe_settings.aux_coef * aux


def dropped_routes(exp_counts: list[torch.Tensor], moe: MoESettings) -> tuple[int, int]:
    """``(dropped, routes)``: routes (token, expert) of this rank's last forward that went past
    their expert's capacity, and all routes, summed over the MoE layers.

    Both libraries keep ``min(count, capacity)`` of an expert's routes, with DeepSpeed's
    capacity ``max(ceil(tokens / E * capacity_factor * k), min_capacity)`` per rank."""
    dropped = routes = 0
    for counts in exp_counts:
        total = int(counts.sum())
        routes += total
        if moe.drop_tokens:
            tokens = total // moe.k
            cap = max(math.ceil(tokens / moe.num_experts * moe.capacity_factor * moe.k), moe.min_capacity)
            dropped += int((counts.long() - cap).clamp(min=0).sum())
    return dropped, routes
