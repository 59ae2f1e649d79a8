"""Losses of sequences split over a sequence-parallel group.

Each rank holds a piece of every sequence; the loss of the whole sequences is the sum of
the pieces' token losses over the sum of their token counts. :func:`mean_over_sequence`
computes it from each piece's sum and count on every rank of the group, with a backward
that sums over the group too, so the gradients the engine averages over the data axis are
those of the whole sequences (see [Note: sequence groups] in ``parallel/_sequence.py``).
Labels must be shifted before the sequence is split (``shift_labels``), or the last token of
each piece would lose its target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from shardwise.sequence._exchange import communicator


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is an all-reduce (sum) of the gradients."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = x.clone()
        comm.all_reduce(out, tag="sequence-parallel loss").wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad, tag="sequence-parallel loss (backward)").wait()
        return grad, None


def mean_over_sequence(loss_sum: Tensor, tokens: Tensor | int, *, group=None) -> Tensor:
    """The mean token loss of the whole sequences: ``sum(loss_sum) / sum(tokens)`` over the
    sequence-parallel ``group`` (a process group or Communicator; default: the group of the
    engine built last). Every rank gets the same value; the backward gives each rank's
    ``loss_sum`` the gradient of that mean summed over the group."""
    from shardwise.utils import groups

    comm = communicator(group, default=groups._get_sequence_parallel_group)
    tokens = torch.as_tensor(tokens, dtype=torch.float32, device=loss_sum.device).reshape(())
    total_tokens = tokens.clone()
    comm.all_reduce(total_tokens, tag="sequence-parallel token count").wait()
    return _SumOverGroup.apply(loss_sum.float(), comm) / total_tokens.clamp_min(1)


def causal_lm_loss(logits: Tensor, shift_labels: Tensor, *, group=None, ignore_index: int = -100) -> Tensor:
    """Cross-entropy of a causal language model over whole sequences whose pieces the ranks of
    ``group`` hold: ``logits`` ``[b, s_local, vocab]`` and the already shifted labels of the
    same positions ``[b, s_local]`` (``ignore_index`` where a position has no target)."""
    loss_sum = F.cross_entropy(
        logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return mean_over_sequence(loss_sum, (shift_labels != ignore_index).sum(), group=group)
