"""``SparseAttentionUtils``: switch a Hugging Face BERT or RoBERTa model to block-sparse
attention, and pad its inputs to a whole number of blocks (DeepSpeed's names)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.ops.sparse_attention.bert_sparse_self_attention import HFBertSparseSelfAttention
from shardwise.ops.sparse_attention.sparsity_config import SparsityConfig

logger = logging.getLogger("shardwise")

_ROBERTA_RESERVED = 2
"""RoBERTa's position table starts with two reserved rows (padding index and below)."""


def _encoder_of(model: nn.Module, what: str) -> tuple[str, nn.Module]:
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return name, getattr(model, name)
    raise ValueError(
        f"SparseAttentionUtils.{what} supports models with a 'bert' or 'roberta' "
        f"attribute (e.g. BertForMaskedLM, RobertaForSequenceClassification); "
        f"{type(model).__name__} has neither. For another model, replace its "
        "self-attention modules with BertSparseSelfAttention yourself"
    )


class SparseAttentionUtils:
    """Helpers to run a pretrained BERT-family model with ``BertSparseSelfAttention``."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Grow the position embeddings of ``model`` (BERT or RoBERTa) to ``max_position``
        positions by repeating the trained table, in place; returns ``model``.

        The new table repeats the original rows from the start (RoBERTa keeps its two
        reserved rows first), cut at ``max_position`` rows when that is not a whole number of
        copies (DeepSpeed then keeps fewer rows than asked for). The embedding's position-id
        buffers and ``config.max_position_embeddings`` follow.

        Args:
            model: a ``transformers`` model with a ``bert`` or ``roberta`` attribute.
            max_position: the new number of positions; more than the model has.
        """
        name, encoder = _encoder_of(model, "extend_position_embedding")
        embeddings = encoder.embeddings
        table = embeddings.position_embeddings
        reserved = _ROBERTA_RESERVED if name == "roberta" else 0
        original = table.weight.shape[0] - reserved
        if max_position <= original:
            raise ValueError(
                f"extend_position_embedding: max_position {max_position} must exceed the model's {original} positions"
            )
        with torch.no_grad():
            trained = table.weight[reserved:]
            copies = -(-max_position // original)
            rows = torch.cat([table.weight[:reserved], trained.repeat(copies, 1)[:max_position]])
        new_table = nn.Embedding(
            rows.shape[0], rows.shape[1], padding_idx=table.padding_idx, device=rows.device, dtype=rows.dtype
        )
        new_table.weight.data.copy_(rows)
        embeddings.position_embeddings = new_table
        total = rows.shape[0]
        for buffer in ("position_ids", "token_type_ids"):
            old = getattr(embeddings, buffer, None)
            if isinstance(old, Tensor) and old.dim() == 2:
                fresh = (
                    torch.arange(total, device=old.device, dtype=old.dtype)[None]
                    if buffer == "position_ids"
                    else torch.zeros(1, total, device=old.device, dtype=old.dtype)
                )
                embeddings.register_buffer(buffer, fresh, persistent=False)
        model.config.max_position_embeddings = total
        logger.info("extended position embeddings from %d to %d positions", original, max_position)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer, max_position: int):
        """Set the tokenizer's ``model_max_length`` (and its saved init argument) to
        ``max_position``; returns the tokenizer."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        logger.info("tokenizer model_max_length set to %d", max_position)
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model: nn.Module, max_position: int, sparsity_config: SparsityConfig | None = None
    ) -> nn.Module:
        """Replace every encoder layer's self-attention of a BERT or RoBERTa ``model`` with
        ``BertSparseSelfAttention`` sharing the trained query, key and value layers; in place.

        ``config.max_position_embeddings`` becomes ``max_position`` (RoBERTa: plus its two
        reserved positions), as DeepSpeed sets it; extend the table itself with
        ``extend_position_embedding``. Call before handing the model to ``initialize``.

        Args:
            model: a ``transformers`` model with a ``bert`` or ``roberta`` attribute.
            max_position: the longest sequence the model will see.
            sparsity_config: the layout, with ``num_heads`` = the model's attention heads;
                None means ``SparsityConfig(num_heads=4)``, DeepSpeed's default, which has no
                layout of its own and is refused when the sparse layers are built, as there.
        """
        name, encoder = _encoder_of(model, "replace_model_self_attention_with_sparse_self_attention")
        model.config.max_position_embeddings = max_position + (_ROBERTA_RESERVED if name == "roberta" else 0)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, encoder.encoder.layer, sparsity_config
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config, layers, sparsity_config: SparsityConfig | None = None
    ):
        """Replace ``layer.attention.self`` of each of ``layers`` with a sparse one that keeps
        the layer's ``query``, ``key`` and ``value``; returns ``layers``."""
        if sparsity_config is None:
            sparsity_config = SparsityConfig(num_heads=4)
        for layer in layers:
            dense = layer.attention.self
            sparse = HFBertSparseSelfAttention(config, sparsity_config)
            sparse.query, sparse.key, sparse.value = dense.query, dense.key, dense.value
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(
        block_size: int,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        token_type_ids: Tensor | None,
        position_ids: Tensor | None,
        inputs_embeds: Tensor | None,
        pad_token_id: int,
        model_embeddings=None,
    ):
        """Pad the sequence dimension to a multiple of ``block_size``.

        Returns ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids,
        inputs_embeds)``: ids and position ids padded with ``pad_token_id``, the attention
        mask with 0 (padding is never attended), token types with 0, and ``inputs_embeds``
        with the embeddings of ``pad_token_id`` from ``model_embeddings`` (required then).
        Inputs given as None stay None (DeepSpeed requires the mask and token types).
        Cut the model's output back with ``unpad_sequence_output(pad_len, output)``.
        """
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pad_to_block_size: pass input_ids or inputs_embeds")
        batch, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError("pad_to_block_size: inputs_embeds need model_embeddings to embed the padding tokens")
            pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)

        def pad(tensor: Tensor | None, value) -> Tensor | None:
            return None if tensor is None else F.pad(tensor, (0, pad_len), value=value)

        return (
            pad_len,
            pad(input_ids, pad_token_id),
            pad(attention_mask, 0),
            pad(token_type_ids, 0),
            pad(position_ids, pad_token_id),
            inputs_embeds,
        )

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: Tensor) -> Tensor:
        """``sequence_output`` without its last ``pad_len`` positions (dimension 1)."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
