"""``BertSparseSelfAttention``: a BERT self-attention block (query, key and value
projections) over ``SparseSelfAttention``, with DeepSpeed's arguments and contract."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardwise.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig


class BertSparseSelfAttention(nn.Module):
    """BERT's self-attention with block-sparse attention probabilities.

    Holds ``query``, ``key`` and ``value`` ``nn.Linear(hidden_size, hidden_size)`` layers (the
    names of a BERT self-attention module, so a BERT checkpoint's weights load into it) and a
    ``SparseSelfAttention`` whose layout covers ``max(2048, config.max_position_embeddings)``
    tokens. There is no dropout on the attention probabilities (DeepSpeed's has none either).

    Args:
        config: a BERT-style model config with ``hidden_size`` and ``num_attention_heads``
            (a ``transformers`` ``BertConfig``, or any object with those attributes).
        sparsity_config: the layout; its ``num_heads`` must equal
            ``config.num_attention_heads``. None means DeepSpeed's default,
            ``FixedSparsityConfig(num_heads=4)``.
    """

    def __init__(self, config, sparsity_config: SparsityConfig | None = None):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads != 0:
            raise ValueError(
                f"BertSparseSelfAttention: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=4)
        if sparsity_config.num_heads != heads:
            raise ValueError(
                f"BertSparseSelfAttention: the sparsity config has num_heads="
                f"{sparsity_config.num_heads} but the model has num_attention_heads={heads}; "
                f"build the config with num_heads={heads}"
            )
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        max_length = max(2048, getattr(config, "max_position_embeddings", 0) or 0)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_length)

    def transpose_for_scores(self, x: Tensor) -> Tensor:
        """``[batch, seq, hidden]`` -> ``[batch, heads, seq, head_size]``."""
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The attention context ``[batch, seq, hidden]`` (before BERT's output projection).

        Args:
            hidden_states: ``[batch, seq, hidden]``, ``seq`` a multiple of the layout's block
                (see ``SparseAttentionUtils.pad_to_block_size``).
            attention_mask: a key padding mask, used in the ``SparseSelfAttention``'s
                ``key_padding_mask_mode`` ("add" by default: BERT's extended mask, 0 where a
                token is attended and a large negative number where it is padding).
                ``[batch, seq]`` or the extended ``[batch, 1, 1, seq]``; None for no padding.
        """
        query, key, value = (
            self.transpose_for_scores(layer(hidden_states)) for layer in (self.query, self.key, self.value)
        )
        context = self.sparse_self_attention(query, key, value, key_padding_mask=attention_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """``BertSparseSelfAttention`` in the place of a Hugging Face ``BertSelfAttention``.

    ``transformers``' BERT and RoBERTa layers call their self-attention with a 4-D mask
    (``[batch, 1, query, key]``: boolean "may attend" under the ``sdpa`` attention
    implementation, additive under ``eager``; None when nothing is padded) and expect a
    ``(context, attention_weights)`` tuple back. This subclass accepts that call: a mask
    whose rows are all the same (padding, the only mask a BERT encoder makes) becomes the
    additive key padding mask; a mask that differs between queries (a decoder's causal
    mask) is refused, since the layout is the only place for structure in the scores.
    Attention weights are never materialised: the second element is None.
    """

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args, **kwargs
    ) -> tuple[Tensor, None]:
        return super().forward(hidden_states, _key_padding_mask(attention_mask)), None


def _key_padding_mask(mask: Tensor | None) -> Tensor | None:
    """An additive ``[batch, seq]`` key padding mask from a Hugging Face attention mask."""
    if mask is None:
        return None
    if mask.dim() == 4:
        if mask.shape[-2] > 1 and not bool((mask == mask[:, :, :1, :]).all()):
            raise ValueError(
                "BertSparseSelfAttention: the attention mask differs between query "
                "positions (a causal or per-query mask); block-sparse attention takes "
                "a key padding mask only - express causality with a unidirectional "
                "sparsity config"
            )
        mask = mask[:, 0, 0, :]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask
