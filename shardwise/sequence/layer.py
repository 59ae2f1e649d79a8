"""DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardwise.sequence._exchange import HeadSplit, ToHeads, ToSequence, communicator, piece_lengths


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """``t * cos + rotate_half(t) * sin`` on the first ``freqs_cos.shape[-1]`` channels of
    ``t`` (the rest pass through), DeepSpeed's rotary helper."""
    rotary = freqs_cos.shape[-1]
    t, rest = t[..., :rotary], t[..., rotary:]
    t = t * freqs_cos + _rotate_half(t) * freqs_sin
    return t if rest.shape[-1] == 0 else torch.cat((t, rest), dim=-1)


class DistributedAttention(nn.Module):
    """DeepSpeed-Ulysses attention: ``local_attention`` on the whole sequence and a share of the
    heads, for inputs split along the sequence over ``sequence_process_group``.

    ``forward(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args, **kwargs)`` takes
    this rank's positions ``[b, s_local, heads, head_dim]`` (``batch_dim_idx=0``) or
    ``[s_local, b, heads, head_dim]`` (1), swaps them for every position of this rank's heads
    (one all-to-all each), applies ``rotary_pos_emb`` (``(cos, sin)`` in DeepSpeed's layout) to
    query and key, calls ``local_attention(q, k, v, *args, **kwargs)`` in the same layout,
    and swaps its output (4-D, or 3-D with heads merged) back to this rank's positions.

    Beyond DeepSpeed: ranks may hold different numbers of positions (a sequence length not
    divisible by the group size needs no padding), head counts need not divide the group size,
    and grouped-query attention with fewer key/value heads than ranks replicates them (see
    [Note: Ulysses head split]); shapes that cannot be split are refused with the reason.

    Args:
        local_attention: attention over whole sequences, e.g. a wrapper of
            ``scaled_dot_product_attention`` in the layout above.
        sequence_process_group: the ranks that share one sequence (a process group, a
            ``shardwise.comm.Communicator``, or None for the whole world).
        scatter_idx: the head dimension (2, DeepSpeed's default and the only one supported).
        gather_idx: the sequence dimension (DeepSpeed passes 0 for both layouts).
        sp_stream: DeepSpeed's stream for overlapping the all-to-alls (accepted; the
            exchanges run on the current stream).
        num_kv_heads: key/value heads before the split (default: read from ``key``).
    """

    def __init__(
        self,
        local_attention: nn.Module,
        sequence_process_group=None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream=None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise ValueError(
                f"DistributedAttention splits heads (scatter_idx=2) and gathers the sequence "
                f"(gather_idx 0 or 1), got scatter_idx={scatter_idx}, gather_idx={gather_idx}"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.comm = communicator(sequence_process_group)
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb=None, *args, **kwargs
    ):
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), got {batch_dim_idx}")
        if not (query.dim() == key.dim() == value.dim() == 4):
            raise ValueError(
                f"query, key and value must be 4-D [b, s, heads, head_dim] or [s, b, heads, head_dim], got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.shape != value.shape:
            raise ValueError(f"key and value must have one shape, got {tuple(key.shape)} and {tuple(value.shape)}")
        first = (lambda t: t) if batch_dim_idx == 0 else (lambda t: t.transpose(0, 1))
        query, key, value = first(query), first(key), first(value)
        kv_heads = self.num_kv_heads or key.shape[2]
        if kv_heads != key.shape[2]:
            raise ValueError(f"num_kv_heads={kv_heads} but key has {key.shape[2]} heads")
        split = HeadSplit.build(query.shape[2], kv_heads, self.comm.world_size)
        lengths = piece_lengths(self.comm, query.shape[1], query.device)
        q, k, v = (
            first(ToHeads.apply(t, self.comm, lengths, heads, f"ulysses {name}"))  # in the caller's layout again
            for t, heads, name in ((query, split.q, "query"), (key, split.kv, "key"), (value, split.kv, "value"))
        )
        if rotary_pos_emb is not None:
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        merged = context.dim() == 3
        if merged:
            context = context.view(*context.shape[:2], q.shape[2], -1)
        out = ToSequence.apply(first(context), self.comm, lengths, split.q, split.q_heads, "ulysses output")
        out = first(out)
        return out.flatten(2) if merged else out
