"""``SparseSelfAttention``: DeepSpeed's block-sparse self-attention layer on
``block_sparse_attention``."""

from __future__ import annotations

from torch import Tensor, nn

from shardwise.ops.sparse_attention._block_sparse import MaskMode, block_sparse_attention


class SparseSelfAttention(nn.Module):
    """Block-sparse scaled dot-product self-attention with a layout from a sparsity config.

    The master layout is made once for ``max_seq_length`` and kept as the buffer
    ``master_layout`` (as in DeepSpeed, so state dicts match); a shorter sequence of
    ``seq_len`` tokens uses its top-left ``[:, :seq_len/block, :seq_len/block]`` corner,
    cached per ``seq_len``. A config that draws random blocks (``num_random_blocks > 0``)
    gives each rank its own draw unless every rank seeded torch alike, so, as in DeepSpeed,
    the first forward broadcasts ``master_layout`` from global rank 0 when
    ``torch.distributed`` is initialised (every rank must then run that first forward, as
    every rank of a data-parallel job does); layouts without random blocks are the same
    everywhere by construction and are never sent. Works in fp32, bf16 and fp16; scores are
    scaled by ``head_dim ** -0.5``.

    Args:
        sparsity_config: a ``SparsityConfig``; None means ``SparsityConfig(num_heads=4)``,
            DeepSpeed's default (whose base class makes no layout, so it fails as there).
        key_padding_mask_mode: "add" adds the key padding mask to the scores, "mul" masks
            where it is 0.
        attn_mask_mode: the same choice for the ``[seq, seq]`` attention mask.
        max_seq_length: the longest sequence accepted; the master layout's size.
    """

    def __init__(
        self,
        sparsity_config=None,
        key_padding_mask_mode: MaskMode = "add",
        attn_mask_mode: MaskMode = "mul",
        max_seq_length: int = 2048,
    ):
        super().__init__()
        if sparsity_config is None:
            from shardwise.ops.sparse_attention.sparsity_config import SparsityConfig

            sparsity_config = SparsityConfig(num_heads=4)
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise ValueError(f"SparseSelfAttention.{name} must be 'add' or 'mul', got {mode!r}")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._layouts: dict[int, tuple[Tensor, Tensor]] = {}
        self._needs_layout_sync = getattr(sparsity_config, "num_random_blocks", 0) > 0

    def _sync_layout(self) -> None:
        """Broadcast a randomly drawn ``master_layout`` from global rank 0, once."""
        self._needs_layout_sync = False
        from shardwise import comm

        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.broadcast(self.master_layout, src=0)

    def get_layout(self, seq_len: int) -> Tensor:
        """The layout ``[heads, seq_len/block, seq_len/block]`` for ``seq_len`` tokens.

        A view of ``master_layout``, reused across calls so the attention plan is found by
        identity (see [Note: block-sparse gather plan]); rebuilt if the buffer is replaced."""
        block = self.sparsity_config.block
        if self._needs_layout_sync:
            self._sync_layout()
        if seq_len % block:
            raise ValueError(
                f"SparseSelfAttention: sequence length {seq_len} is not a multiple of "
                f"block {block}; pad the inputs with "
                "SparseAttentionUtils.pad_to_block_size"
            )
        if seq_len > self.max_seq_length:
            raise ValueError(
                f"SparseSelfAttention: sequence length {seq_len} exceeds max_seq_length {self.max_seq_length}"
            )
        cached = self._layouts.get(seq_len)
        if cached is None or cached[0] is not self.master_layout:
            num_blocks = seq_len // block
            cached = (self.master_layout, self.master_layout[:, :num_blocks, :num_blocks])
            self._layouts[seq_len] = cached
        return cached[1]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        rpe: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Attention output ``[batch, heads, seq, head_dim]``.

        Args:
            query, key, value: ``[batch, heads, seq, head_dim]``; ``key`` may also come
                transposed, ``[batch, heads, head_dim, seq]``, as DeepSpeed accepts.
            rpe: relative position scores ``[heads or 1, seq, seq]``, added to the scaled scores.
            key_padding_mask: ``[batch, seq]`` (extra singleton dims are accepted).
            attn_mask: ``[seq, seq]``.
        """
        _, num_heads, seq_len, head_dim = query.shape
        if key.shape[-2] != seq_len and key.shape[-1] == seq_len:
            key = key.transpose(-1, -2)
        if query.shape != key.shape or key.shape != value.shape:
            raise ValueError(
                "SparseSelfAttention supports self-attention only: query, key and value "
                f"shapes differ: {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}"
            )
        if num_heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"SparseSelfAttention: query has {num_heads} heads but the sparsity "
                f"config has num_heads={self.sparsity_config.num_heads}"
            )
        layout = self.get_layout(seq_len)
        return block_sparse_attention(
            query,
            key,
            value,
            layout,
            self.sparsity_config.block,
            scale=float(head_dim) ** -0.5,
            key_padding_mask=key_padding_mask,
            key_padding_mask_mode=self.key_padding_mask_mode,
            attn_mask=attn_mask,
            attn_mask_mode=self.attn_mask_mode,
            rpe=rpe,
        )
