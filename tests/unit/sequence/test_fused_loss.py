"""The fused linear cross-entropy (``linear_cross_entropy_sum``; ``fused_causal_lm_loss`` is
trained over a sequence group in tests/dist/sequence/test_sequence_parallel_training.py):
the loss and every gradient equal ``F.cross_entropy`` of the whole logits, with tiles that do
not divide the rows, ignored targets, a bias and a scale applied after the loss."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.sequence.loss import linear_cross_entropy_sum

H, V = 16, 50


def _inputs(dtype=torch.float32, bias=True):
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=bias, dtype=dtype)
    hidden = torch.randn(2, 13, H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (2, 13))
    labels[0, :4] = -100
    labels[1, -1] = -100
    return head, hidden, labels


def _grads(head, hidden):
    tensors = [hidden, *head.parameters()]
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


@pytest.mark.parametrize("tile_tokens", [1, 5, 26, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_cross_entropy_of_the_whole_logits(tile_tokens, dtype):
    head, hidden, labels = _inputs(dtype)
    loss = linear_cross_entropy_sum(hidden, head.weight, labels, head.bias, tile_tokens=tile_tokens)
    (3.0 * loss).backward()  # the scale must reach every gradient
    got = [loss.detach(), *_grads(head, hidden)]
    reference = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    (3.0 * reference).backward()
    for a, b in zip(got, [reference.detach(), *_grads(head, hidden)]):
        torch.testing.assert_close(a, b)


def test_bad_input_is_refused():
    head, hidden, labels = _inputs()
    with pytest.raises(ValueError, match="same positions"):
        linear_cross_entropy_sum(hidden, head.weight, labels[:, :5])
    head.weight.ds_shape = head.weight.shape  # what ZeRO-3 marks its parameters with
    with pytest.raises(ValueError, match="ZeRO-3"):
        linear_cross_entropy_sum(hidden, head.weight, labels)
