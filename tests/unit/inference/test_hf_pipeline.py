"""DeepSpeed's tutorial path: a ``transformers.pipeline`` whose model is replaced by the
engine (``pipe.model = init_inference(pipe.model, ...)``) generates the plain pipeline's
text, with a word-level tokenizer built in memory (no downloads)."""

import copy

import pytest
import torch

import shardwise
from shardwise.testing.causal_lm import VOCAB, tiny_lm


def _tokenizer():
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "kernel_inject"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_with_the_engine_as_model(family, inject):
    import transformers

    tokenizer = _tokenizer()
    model = tiny_lm(family)
    plain = transformers.pipeline("text-generation", model=copy.deepcopy(model), tokenizer=tokenizer, device="cpu")
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    pipe.model = shardwise.init_inference(pipe.model, dtype=torch.float32, replace_with_kernel_inject=inject)
    prompts = ["w5 w17 w9 w44", "w100 w3"]
    want = plain(prompts, max_new_tokens=16, do_sample=False)
    got = pipe(prompts, max_new_tokens=16, do_sample=False)
    assert got == want
    assert len(got[0][0]["generated_text"].split()) > 4
    assert pipe.model.last_generation.new_tokens == 16
    assert pipe.model.fast_path == inject
