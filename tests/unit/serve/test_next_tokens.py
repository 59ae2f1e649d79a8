"""The batching engine picks a step's tokens together: the greedy rows in one argmax over the
batch, the sampled rows one by one with their own generators, a failing row alone."""

import math

import torch

from shardwise.serve._api import SamplingParams, sample
from shardwise.serve._batching import _Request, next_tokens


def _request(params, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return _Request(stream=None, params=params, generator=generator, submitted=0.0)


def test_each_row_gets_what_it_would_get_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    kinds = [(greedy, None), (sampled, 3), (greedy, None), (sampled, 7), (greedy, None)]
    tokens = next_tokens(logits, [_request(p, s) for p, s in kinds])
    alone = [sample(row, p, None if s is None else torch.Generator().manual_seed(s)) for row, (p, s) in
             zip(logits, kinds)]  # fmt: skip
    assert tokens == alone
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())


def test_an_all_greedy_batch_and_a_failing_row():
    logits = torch.randn(3, 10)
    assert next_tokens(logits, [_request(SamplingParams(temperature=0))] * 3) == logits.argmax(-1).tolist()
    logits[1] = math.nan  # sampling this row raises; the others still get their tokens
    tokens = next_tokens(logits, [_request(SamplingParams(temperature=0)), _request(SamplingParams(), 1),
                                  _request(SamplingParams(temperature=0))])  # fmt: skip
    assert isinstance(tokens[1], RuntimeError)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
