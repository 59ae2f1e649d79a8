"""A small GPT-style decoder and a byte-level corpus that needs no download.

Used by the demo (``train_gpt.py``) and the benchmarks (``bench/``), so both train the
same architecture: token + learned position embeddings, pre-LayerNorm blocks with causal
scaled-dot-product attention and a 4x GELU MLP, a final LayerNorm, and an output head
tied to the token embedding (untied in the benchmark presets, whose parameter counts
BENCHMARKS.md states that way).
"""

from __future__ import annotations

import contextlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    from shardwise.runtime.data_pipeline import drop_layer, truncate_to_curriculum
    from shardwise.zero import GatheredParameters
except ImportError:  # the benchmarks run this model under other libraries too (no keywords passed)
    GatheredParameters = drop_layer = truncate_to_curriculum = None


def _gathered(params):
    if GatheredParameters is None or not params:
        return contextlib.nullcontext()
    return GatheredParameters(params, modifier_rank=0)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    width: int = 512
    num_layers: int = 6
    num_heads: int = 8
    seq_len: int = 256
    dropout: float = 0.0
    tie_weights: bool = True
    """Share the output head's weight with the token embedding."""


GPT_PRESETS = {
    "tiny": GPTConfig(vocab_size=256, width=64, num_layers=2, num_heads=4, seq_len=64),
    "reference": GPTConfig(tie_weights=False),
    "memory": GPTConfig(vocab_size=32000, width=1024, num_layers=8, num_heads=16, seq_len=64, tie_weights=False),
}
"""Sizes used by tests ("tiny"), the step-time benchmark ("reference", about 27.4M
parameters) and the memory benchmark ("memory", about 166M parameters)."""


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.ln1 = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.ln2 = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.out = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``forward(idx)`` returns logits; ``forward(idx, targets)`` the mean cross-entropy."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.width)
        self.pos_emb = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self._layer_drop_draws: torch.Generator | None = None
        residual = {block.proj for block in self.blocks} | {block.out for block in self.blocks}
        for module in self.modules():
            # built under zero.Init a module's parameters are partitioned already: gather them
            # to write the initial values (rank 0's are kept)
            with _gathered(list(module.parameters(recurse=False))):
                self._init(module, config, residual=module in residual)

    @staticmethod
    def _init(module: nn.Module, config: GPTConfig, *, residual: bool) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # residual projections scaled by depth (GPT-2)
            std = 0.02 / math.sqrt(2 * config.num_layers) if residual else 0.02
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        curriculum_seqlen: int | None = None,
        progressive_layer_drop: bool = False,
        pld_theta: float | None = None,
    ) -> torch.Tensor:
        """The engine passes ``curriculum_seqlen`` (the config's ``curriculum_learning``: the
        batch is cut to it) and ``pld_theta`` (``progressive_layer_drop``: blocks are skipped
        with it while training, by draws alike on every rank) to training forwards."""
        del progressive_layer_drop  # pld_theta is None when layer drop is off
        if curriculum_seqlen is not None:
            idx, targets = truncate_to_curriculum((idx, targets), curriculum_seqlen)
        if pld_theta is not None and self._layer_drop_draws is None:  # the same seed on every rank
            self._layer_drop_draws = torch.Generator().manual_seed(self.config.seq_len)
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for i, block in enumerate(self.blocks):
            if pld_theta is None:
                x = block(x)
            else:
                x = drop_layer(
                    block,
                    x,
                    theta=pld_theta,
                    layer_index=i,
                    num_layers=len(self.blocks),
                    generator=self._layer_drop_draws,
                )
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def byte_corpus(*, max_bytes: int = 4_000_000) -> torch.Tensor:
    """The Python standard library's own ``.py`` sources as byte tokens (vocab 256).

    Files are read in sorted order, so the corpus is the same on every rank and run.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 1024:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class ByteBlocks(torch.utils.data.Dataset):
    """Non-overlapping ``(x, y)`` windows of ``seq_len`` tokens, ``y`` shifted by one."""

    def __init__(self, corpus: torch.Tensor, *, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.seq_len

    def __getitem__(self, index: int):
        start = index * self.seq_len
        window = self.corpus[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]
