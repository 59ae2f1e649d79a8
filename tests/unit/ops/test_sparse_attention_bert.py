"""A Hugging Face BERT / RoBERTa switched to block-sparse attention with SparseAttentionUtils:
with a dense layout it computes what the original model computes (outputs and gradients,
padding included); the utilities pad, unpad and extend as documented."""

import copy

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

from shardwise.ops.sparse_attention import (
    BertSparseSelfAttention,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    SparseAttentionUtils,
)

HEADS, BLOCK = 4, 8


def _model(family, attn_implementation):
    kwargs = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    if family == "bert":
        return BertForMaskedLM(BertConfig(**kwargs, attn_implementation=attn_implementation))
    return RobertaForMaskedLM(RobertaConfig(**kwargs, attn_implementation=attn_implementation))


def _batch(seq=27):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, 50, (2, seq), generator=generator)
    attention_mask = torch.ones(2, seq, dtype=torch.long)
    attention_mask[1, seq - 9 :] = 0
    input_ids[1, seq - 9 :] = 1
    return input_ids, attention_mask


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_dense_layout_matches_the_original_model(family, attn_implementation):
    model = _model(family, attn_implementation)
    dense = copy.deepcopy(model)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, max_position=32, sparsity_config=DenseSparsityConfig(num_heads=HEADS, block=BLOCK)
    )
    encoder = getattr(model, family).encoder
    assert all(isinstance(layer.attention.self, BertSparseSelfAttention) for layer in encoder.layer)
    input_ids, attention_mask = _batch()
    pad_len, ids, mask, _, _, _ = SparseAttentionUtils.pad_to_block_size(
        BLOCK, input_ids, attention_mask, None, None, None, pad_token_id=1
    )
    assert pad_len == 5 and ids.shape[1] == 32 and int(mask[:, 27:].sum()) == 0
    labels = torch.randint(2, 50, input_ids.shape, generator=torch.Generator().manual_seed(2))
    got = SparseAttentionUtils.unpad_sequence_output(pad_len, model(input_ids=ids, attention_mask=mask).logits)
    want = dense(input_ids=input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()  # padded query positions are not compared
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    loss = torch.nn.functional.cross_entropy(got[keep], labels[keep])
    reference = torch.nn.functional.cross_entropy(want[keep], labels[keep])
    loss.backward()
    reference.backward()
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_a_sparse_layout_changes_the_output_and_keeps_the_weights():
    model = _model("bert", "sdpa")
    dense = copy.deepcopy(model)
    query = model.bert.encoder.layer[0].attention.self.query
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model,
        max_position=32,
        sparsity_config=BSLongformerSparsityConfig(num_heads=HEADS, block=BLOCK, num_sliding_window_blocks=1),
    )
    assert model.bert.encoder.layer[0].attention.self.query is query
    assert model.config.max_position_embeddings == 32
    input_ids, attention_mask = _batch(32)
    got = model(input_ids=input_ids, attention_mask=attention_mask).logits
    want = dense(input_ids=input_ids, attention_mask=attention_mask).logits
    assert (got - want).abs().max() > 1e-3  # a window of one block sees less than the whole sequence


def test_a_per_query_mask_is_refused():
    attention = BertSparseSelfAttention(
        _model("bert", "sdpa").config, DenseSparsityConfig(num_heads=HEADS, block=BLOCK)
    )
    from shardwise.ops.sparse_attention.bert_sparse_self_attention import HFBertSparseSelfAttention

    hf = HFBertSparseSelfAttention(_model("bert", "sdpa").config, DenseSparsityConfig(num_heads=HEADS, block=BLOCK))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()[None, None]
    with pytest.raises(ValueError, match="differs between query positions"):
        hf(torch.randn(1, 16, 32), causal)
    out = attention(torch.randn(1, 16, 32), torch.zeros(1, 1, 1, 16))
    assert out.shape == (1, 16, 32)


def test_heads_must_match_the_model():
    with pytest.raises(ValueError, match="num_heads=2 but the model has num_attention_heads=4"):
        BertSparseSelfAttention(_model("bert", "sdpa").config, DenseSparsityConfig(num_heads=2))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_extend_position_embedding_repeats_the_table(family):
    model = _model(family, "sdpa")
    table = getattr(model, family).embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 100)
    embeddings = getattr(model, family).embeddings
    new = embeddings.position_embeddings.weight
    reserved = 2 if family == "roberta" else 0
    original = table.shape[0] - reserved
    assert new.shape[0] == 100 + reserved == model.config.max_position_embeddings
    torch.testing.assert_close(new[: table.shape[0]], table)
    torch.testing.assert_close(new[reserved + original : reserved + 2 * original], table[reserved:])
    ids = torch.randint(2, 50, (1, 96))
    assert model(input_ids=ids).logits.shape == (1, 96, 50)  # the position-id buffers grew too
    with pytest.raises(ValueError, match="must exceed"):
        SparseAttentionUtils.extend_position_embedding(model, 50)
    with pytest.raises(ValueError, match="'bert' or 'roberta'"):
        SparseAttentionUtils.extend_position_embedding(torch.nn.Linear(2, 2), 50)


def test_pad_to_block_size_with_embeddings_and_tokenizer_length():
    model = _model("bert", "sdpa")
    embeds = torch.randn(2, 10, 32)
    pad_len, ids, mask, types, positions, padded = SparseAttentionUtils.pad_to_block_size(
        8,
        None,
        torch.ones(2, 10),
        torch.zeros(2, 10, dtype=torch.long),
        torch.arange(10).expand(2, 10),
        embeds,
        pad_token_id=1,
        model_embeddings=model.bert.embeddings.word_embeddings,
    )
    assert pad_len == 6 and ids is None and padded.shape == (2, 16, 32)
    assert mask[:, 10:].eq(0).all() and types.shape == (2, 16) and positions[:, 10:].eq(1).all()
    torch.testing.assert_close(padded[:, 10], model.bert.embeddings.word_embeddings.weight[1].expand(2, 32))
    assert (
        SparseAttentionUtils.pad_to_block_size(
            8, torch.ones(1, 16, dtype=torch.long), None, None, None, None, pad_token_id=0
        )[0]
        == 0
    )

    class Tokenizer:
        model_max_length = 512
        init_kwargs = {}

    tokenizer = SparseAttentionUtils.update_tokenizer_model_max_length(Tokenizer(), 4096)
    assert tokenizer.model_max_length == 4096 and tokenizer.init_kwargs["model_max_length"] == 4096


def test_pad_to_block_size_names_what_is_missing():
    with pytest.raises(ValueError, match="pass input_ids or inputs_embeds"):
        SparseAttentionUtils.pad_to_block_size(8, None, None, None, None, None, pad_token_id=0)
    with pytest.raises(ValueError, match="inputs_embeds need model_embeddings"):
        SparseAttentionUtils.pad_to_block_size(8, None, None, None, None, torch.randn(1, 5, 4), pad_token_id=0)
