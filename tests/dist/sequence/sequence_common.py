"""A tiny causal language model whose attention is DeepSpeed-Ulysses ``DistributedAttention``
when given a sequence-parallel group (plain attention otherwise), its data, and the
single-process reference it is compared with."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 4, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(
            WIDTH, 3 * WIDTH, bias=False
        )  # a key bias has a zero gradient: AdamW would amplify its noise
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.attention = None  # DistributedAttention, set by use_sequence_parallel
        self.seen = []  # (positions in the MLP, positions and heads in attention)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, WIDTH // HEADS).unbind(2)
        if self.attention is None:
            context = _causal(q, k, v)
        else:
            context = self.attention(q, k, v, 0)
        x = x + self.out(context.reshape(b, s, WIDTH))
        self.seen.append(s)
        return x + self.mlp(x)


def _causal(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.attention_seen = []
        self.checkpointed = False  # each block under shardwise.checkpointing.checkpoint

    def forward(self, ids, position_ids, hidden=False):
        from shardwise import checkpointing

        x = self.embed(ids) + self.position(position_ids)
        for block in self.blocks:
            x = checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        return x if hidden else self.head(x)


def use_sequence_parallel(model, comm):
    from shardwise.sequence.layer import DistributedAttention

    def local(q, k, v):
        model.attention_seen.append((q.shape[1], q.shape[2]))
        return _causal(q, k, v)

    for block in model.blocks:
        block.attention = DistributedAttention(local, comm)


def samples(steps, replicas, batch=2):
    """``[steps][replicas]`` of (ids, shifted labels), with some labels ignored."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        row = []
        for _ in range(replicas):
            ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
            labels = ids.roll(-1, dims=1)
            labels[:, -1] = -100  # shifted before any split: the last position has no target
            labels[0, :3] = -100  # uneven token counts between the pieces
            row.append((ids, labels))
        out.append(row)
    return out


def reference(steps_data, optimizer_name, lr, accumulation=1, bf16_start=False):
    """Per-micro-step losses ([micro steps][replicas]) and final weights of single-process
    training on whole sequences, the loss averaged over the replicas' samples and the
    ``accumulation`` micro-steps of each optimizer step; ``bf16_start`` rounds the initial
    weights to bf16 first, as a bf16 engine's fp32 masters start."""
    model = TinyLM()
    if bf16_start:
        model = model.to(torch.bfloat16).float()
    optimizer = (torch.optim.SGD if optimizer_name == "sgd" else torch.optim.AdamW)(model.parameters(), lr=lr)
    losses = []
    for micro, row in enumerate(steps_data):
        per = []
        for ids, labels in row:
            logits = model(ids, torch.arange(SEQ).expand_as(ids))
            per.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
        (torch.stack(per).mean() / accumulation).backward()
        if (micro + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
        losses.append([float(p) for p in per])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
