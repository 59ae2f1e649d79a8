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


def fused_causal_lm_loss(
    hidden: Tensor,
    head: torch.nn.Module,
    shift_labels: Tensor,
    *,
    group=None,
    ignore_index: int = -100,
    tile_tokens: int | None = None,
) -> Tensor:
    """:func:`causal_lm_loss` of ``head(hidden)`` without the whole logits: ``hidden``
    ``[b, s_local, h]``, ``head`` a linear layer (``weight [vocab, h]``, optional bias), the
    logits computed ``tile_tokens`` rows at a time (see [Note: fused linear cross-entropy])."""
    loss_sum = linear_cross_entropy_sum(
        hidden, head.weight, shift_labels, head.bias, ignore_index=ignore_index, tile_tokens=tile_tokens
    )
    return mean_over_sequence(loss_sum, (shift_labels != ignore_index).sum(), group=group)


def linear_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    tile_tokens: int | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels, reduction="sum")`` over the rows of
    ``hidden`` ``[..., h]`` and ``labels`` ``[...]``, with at most ``tile_tokens`` rows of
    logits alive at a time (default: about 64 MiB of fp32 logits). See
    [Note: fused linear cross-entropy]."""
    if hasattr(weight, "ds_shape"):
        raise ValueError(
            "the fused loss reads the head's weight outside its forward, which ZeRO-3 does not allow: "
            "use TiledFusedLogitsLoss (it recomputes under ZeRO-3) or ZeRO 0-2"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must hold the same positions")
    rows = tile_tokens or max(1, (1 << 24) // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index, rows)


class _LinearCrossEntropy(torch.autograd.Function):
    """[Note: fused linear cross-entropy]
    The loss is a scalar, so forward computes its gradients too, one tile of rows at a time,
    and backward only scales them by the incoming gradient. Per tile one fp32 logits buffer is
    turned in place into the gradient of the logits: the target's logit is read, the rows'
    maximum subtracted and ``exp`` taken, the row sums give the log-sum-exp (the loss), the
    division by them the softmax, and 1 is subtracted at each target (rows without a target are
    zeroed). ``grad_hidden = g @ W`` and ``grad_W += g^T @ hidden`` follow, and the buffer is
    reused by the next tile. A plain ``cross_entropy`` of the logits holds the logits, their
    log-softmax and the gradient (three buffers, per tile when tiled with
    ``TiledFusedLogitsLoss``); this holds one, plus a gradient buffer the size of the head, and
    runs no second head forward in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, rows):
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad_hidden = torch.zeros_like(flat) if hidden.requires_grad else None
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 arithmetic, or wider
        grad_weight = torch.zeros_like(weight, dtype=acc) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and bias.requires_grad else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, flat.shape[0], rows):
            h, y = flat[start : start + rows], targets[start : start + rows]
            g, loss = _logits_grad(h, weight, bias, y, ignore_index, acc)
            total += loss
            g = g.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(g, weight.to(hidden.dtype), out=grad_hidden[start : start + rows])
            if grad_weight is not None:
                grad_weight.addmm_(g.t().to(acc), h.to(acc))
            if grad_bias is not None:
                grad_bias += g.to(acc).sum(0)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.shapes = (hidden.shape, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None
        shape, weight_dtype, bias_dtype = ctx.shapes
        if grad_hidden is not None:  # the buffers are this function's own: scaled in place
            grad_hidden = grad_hidden.mul_(grad.to(grad_hidden.dtype)).reshape(shape)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits_grad(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int, acc):
    """The gradient of ``sum(cross_entropy(h @ W.T + b, targets))`` with respect to the logits
    (in ``acc``, computed in one buffer) and that sum."""
    logits = torch.mm(h, weight.t().to(h.dtype)).to(acc)
    if bias is not None:
        logits += bias.to(acc)
    valid = targets != ignore_index
    index = torch.where(valid, targets, 0)[:, None]
    target_logit = logits.gather(1, index)[:, 0]
    peak = logits.amax(dim=1, keepdim=True)
    logits.sub_(peak).exp_()
    sums = logits.sum(dim=1, keepdim=True)
    loss = ((peak + sums.log())[:, 0] - target_logit)[valid].sum()
    logits.div_(sums)
    logits.scatter_add_(1, index, torch.full_like(target_logit, -1.0)[:, None])
    logits.mul_(valid[:, None])
    return logits, loss
