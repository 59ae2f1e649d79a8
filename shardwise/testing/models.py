"""Small deterministic models and data for equivalence tests."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """Embedding -> LayerNorm'd MLP -> tied output head; returns the mean cross-entropy.

    Has the features tests need: tied weights, a LayerNorm, biases, and an optionally
    frozen layer. Input ``(tokens, targets)`` of shape ``(batch, seq)``.
    """

    def __init__(self, vocab: int = 32, width: int = 16, *, seed: int = 0, freeze_first: bool = False, passes: int = 1):
        super().__init__()
        self.passes = passes  # >1 calls the same layers several times per forward
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        from shardwise.zero import GatheredParameters

        for p in self.parameters():
            # partitioned already when built under zero.Init: rank 0's values are kept
            with torch.no_grad(), GatheredParameters(p, modifier_rank=0):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        if freeze_first:
            self.fc1.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for _ in range(self.passes):
            h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))
        logits = self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def token_batches(*, num_steps: int, batch: int, seq: int = 8, vocab: int = 32, seed: int = 0):
    """``num_steps`` global batches of ``(tokens, targets)``, each ``(batch, seq)``."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=generator),
            torch.randint(0, vocab, (batch, seq), generator=generator),
        )
        for _ in range(num_steps)
    ]


class PipelineBlock(nn.Module):
    """A residual LayerNorm -> Linear -> tanh block, the unit of the pipeline tests' stacks."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def tied_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """An output head reusing ``embedding``'s weight (a ``TiedLayerSpec`` ``forward_fn``)."""
    return x @ embedding.weight.t()


def pipeline_specs(num_blocks: int, *, tied: bool, vocab: int, width: int) -> list:
    """Embedding, ``num_blocks`` :class:`PipelineBlock`, output head as pipeline layer specs;
    with ``tied`` the head reuses the embedding (one ``TiedLayerSpec`` key)."""
    from shardwise.pipe import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("embed", nn.Embedding, vocab, width) if tied else LayerSpec(nn.Embedding, vocab, width)
    last = (
        TiedLayerSpec("embed", nn.Embedding, vocab, width, forward_fn=tied_head)
        if tied
        else LayerSpec(nn.Linear, width, vocab)
    )
    return [first] + [LayerSpec(PipelineBlock, width) for _ in range(num_blocks)] + [last]
