"""Cross-entropy over logits whose vocabulary is split across the tensor group.

[Note: vocab-parallel softmax]
Each rank holds the logits of its vocabulary chunk ``[r * V / tp, (r + 1) * V / tp)``,
the chunk a column-parallel output layer (``gather_output=False``) or a
``VocabParallelEmbedding`` used as the output layer produces. The loss
``log(sum_j exp(z_j - m)) - (z_target - m)`` needs three things no rank has alone: the
maximum ``m`` (all-reduced with MAX, which keeps ``exp`` from overflowing), the sum of
``exp(z_j - m)`` and the target's logit, which only the rank owning the target holds
(the others contribute zero). The last two, plus the sum of logits label smoothing needs,
travel in one summing all-reduce, so the loss costs two small all-reduces of
``num_tokens`` elements, never the ``[tokens, V]`` logits. The backward is local:
``softmax - (1 - eps) * one_hot(target) - eps / V``, this rank's chunk of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.tensor_parallel._comm import as_tensor_comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, comm, label_smoothing):
        local_vocab = logits.shape[-1]
        start = comm.rank * local_vocab
        vocab = local_vocab * comm.world_size
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        top = logits.amax(dim=-1)
        comm.all_reduce(top, op=dist.ReduceOp.MAX, tag="tp.vocab_parallel_cross_entropy.max").wait()
        shifted = logits - top.unsqueeze(-1)
        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)
        exp = shifted.exp()
        sums = [target_logit, exp.sum(dim=-1)] + ([shifted.sum(dim=-1)] if label_smoothing else [])
        sums = torch.stack(sums)
        comm.all_reduce(sums, tag="tp.vocab_parallel_cross_entropy.sums").wait()
        log_z = sums[1].log()
        loss = log_z - sums[0]
        if label_smoothing:
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_z - sums[2] / vocab)
        softmax = exp.div_(sums[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        hit = (~outside).to(softmax.dtype).unsqueeze(-1) * (1 - ctx.label_smoothing)
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -hit)
        if ctx.label_smoothing:
            grad = grad - ctx.label_smoothing / ctx.vocab
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, group, label_smoothing: float = 0.0
) -> torch.Tensor:
    """The per-token cross-entropy of logits split by vocabulary over the tensor group.

    Equals ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(),
    reduction="none", label_smoothing=label_smoothing).view(target.shape)`` on the
    gathered logits, without gathering them (see [Note: vocab-parallel softmax]). Every
    tensor rank returns the same loss; each gets the gradient of its own logits. Like
    Megatron's, it returns the loss per token and ignores no index: mask and average it
    yourself (``(loss * loss_mask).sum() / loss_mask.sum()``). Unlike Megatron's, label
    smoothing follows PyTorch's definition (``eps`` spread over all ``V`` classes).

    The softmax is computed and kept for backward in fp32 (one fp32 copy of the local
    logits); the loss is fp32 and the logits' gradient has the logits' dtype.

    Args:
        vocab_parallel_logits: ``[..., V / tp_degree]``, this rank's vocabulary chunk
            (chunks in rank order, as a column-parallel layer produces them).
        target: ``[...]`` class indices into the full vocabulary, the same on every
            tensor rank.
        group: the tensor-parallel group: a process group, a Communicator, a grid or an
            mpu (see :func:`as_tensor_comm`).
        label_smoothing: ``eps`` in ``[0, 1)``, as in ``F.cross_entropy``.

    Returns:
        The loss per token, shaped like ``target``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, as_tensor_comm(group), float(label_smoothing)
    )
