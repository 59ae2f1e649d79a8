"""``shardwise serve --dtype auto`` serves the checkpoint's own dtype; a named dtype converts."""

import pytest
import torch

from shardwise.testing.causal_lm import tiny_lm


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    import tokenizers
    import transformers

    path = tmp_path_factory.mktemp("bf16")
    tiny_lm("llama").to(torch.bfloat16).save_pretrained(path)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<pad>": 0, "w": 1}, unk_token="<pad>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>").save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype, want", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_dtype_auto_keeps_the_checkpoints_dtype(bf16_dir, dtype, want):
    from shardwise.serve._cli import load_model

    model, tokenizer = load_model(str(bf16_dir), dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    assert not model.training and tokenizer.convert_tokens_to_ids("w") == 1
