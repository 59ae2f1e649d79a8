"""ALST's tiled compute: a function of a long sequence run in tiles, so only one tile's
intermediate activations exist at a time.

[Note: tiled compute]
Forward runs ``fn`` on each tile of the sequence without recording the graph and keeps only
the inputs; backward runs ``fn`` again on one tile at a time with the graph, back-propagates
that tile's share of the incoming gradient (into the parameters, through autograd, so ZeRO's
gradient hooks see them as usual), and assembles the inputs' gradient. The cost is a second
forward of ``fn``; the memory of its intermediates (an MLP's ``[b, s, 4h]``, the logits
``[b, s, vocab]``) drops to one tile's.

DeepSpeed's ``TiledFusedLogitsLoss`` runs the backward inside the forward and scales the
inputs' gradient by the incoming one afterwards, so the parameters' gradients miss any
scale applied to the loss later (gradient accumulation, fp16 loss scaling). Here the loss
is recomputed in backward like everything else, so both get the incoming gradient. A
``"mean"`` reduction averages over every element of the assembled output (DeepSpeed's
divides the gradient by the number of tiles whatever the output's size).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _tiles(length: int, shards: int) -> list[slice]:
    step = math.ceil(length / max(shards, 1))
    return [slice(start, min(start + step, length)) for start in range(0, length, step)] or [slice(0, 0)]


def _detached(tensor: Tensor, requires_grad: bool) -> Tensor:
    return tensor.detach().requires_grad_(requires_grad)


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind :func:`sequence_tiled_compute` (see [Note: tiled compute])."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_key, compute_params, unshard_dim, reduction,
                *args):  # fmt: skip
        if reduction not in (None, "mean", "sum"):
            raise ValueError(f"output_reduction must be None, 'mean' or 'sum', got {reduction!r}")
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :]))
        if grad_key not in sharded:
            raise ValueError(f"grad_requiring_tensor_key {grad_key!r} must be one of kwargs_to_shard {keys_to_shard}")
        tiles = _tiles(seqlen, shards)
        with torch.no_grad():
            outputs = [fn(**{k: v[:, tile] for k, v in sharded.items()}, **passed) for tile in tiles]
        whole = torch.stack(outputs) if unshard_dim == 0 else torch.cat(outputs, dim=unshard_dim)
        ctx.fn, ctx.tiles, ctx.sharded, ctx.passed, ctx.grad_key = fn, tiles, sharded, passed, grad_key
        ctx.unshard_dim, ctx.reduction, ctx.numel = unshard_dim, reduction, whole.numel()
        ctx.index = (list(keys_to_shard) + list(keys_to_pass)).index(grad_key)
        ctx.nargs = len(args)
        if reduction is None:
            return whole
        return whole.mean() if reduction == "mean" else whole.sum()

    @staticmethod
    def backward(ctx, grad):
        source = ctx.sharded[ctx.grad_key]
        grad_in = torch.zeros_like(source)
        if ctx.reduction == "mean":
            grad = grad / ctx.numel
        offset = 0
        for i, tile in enumerate(ctx.tiles):
            inputs = {k: v[:, tile] for k, v in ctx.sharded.items()}
            inputs[ctx.grad_key] = _detached(inputs[ctx.grad_key], source.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(**inputs, **ctx.passed)
            if ctx.reduction is not None:
                tile_grad = grad.expand_as(out)
            elif ctx.unshard_dim == 0:
                tile_grad = grad[i]
            else:
                tile_grad = grad.narrow(ctx.unshard_dim, offset, out.shape[ctx.unshard_dim])
                offset += out.shape[ctx.unshard_dim]
            torch.autograd.backward(out, tile_grad)
            if source.requires_grad:
                grad_in[:, tile] = inputs[ctx.grad_key].grad
        arg_grads = [None] * ctx.nargs
        arg_grads[ctx.index] = grad_in if source.requires_grad else None
        return (None,) * 9 + tuple(arg_grads)


def sequence_tiled_compute(
    fn,
    seqlen,
    shards,
    kwargs_to_shard,
    kwargs_to_pass,
    grad_requiring_tensor_key,
    compute_params=None,
    output_unshard_dimension=1,
    output_reduction="mean",
):
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` run in ``shards`` tiles of the sequence
    (dimension 1 of every ``kwargs_to_shard`` tensor, ``seqlen`` long), its outputs joined
    along ``output_unshard_dimension`` (0: each tile's output is one element of a new first
    dimension) and reduced by ``output_reduction`` (None, "mean" or "sum"); the gradient
    flows to ``kwargs_to_shard[grad_requiring_tensor_key]`` and to ``fn``'s parameters
    (see [Note: tiled compute]). ``compute_params`` is accepted for DeepSpeed's signature
    (shardwise's ZeRO needs no hint)."""
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` (an MLP's forward) run over ``shards`` tiles of the sequence of ``x``
    ``[b, s, h]``: ``TiledMLP.apply(fn, self, x, shards, compute_params)`` (see
    [Note: tiled compute]); ``compute_params`` is accepted for DeepSpeed's signature."""

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params=None):
        ctx.fn, ctx.module, ctx.tiles = fn, module, _tiles(x.shape[1], shards)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, x[:, tile]) for tile in ctx.tiles], dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad_x = torch.zeros_like(x) if x.requires_grad else None
        for tile in ctx.tiles:
            piece = _detached(x[:, tile], x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            torch.autograd.backward(out, grad[:, tile])
            if grad_x is not None:
                grad_x[:, tile] = piece.grad
        return None, None, grad_x, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss computed from hidden states without the whole logits tensor:
    ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`` runs ``fn(self, x_tile, y_tile[, mask_tile])`` (say, the LM head and
    a cross-entropy) on each tile of the sequence and reduces the tiles' losses by
    ``output_reduction``: "mean" averages the tiles' outputs, "sum" adds them (use "sum" and
    divide by the token count yourself when tiles hold different numbers of targets). The
    backward recomputes each tile's logits (see [Note: tiled compute])."""

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, compute_params=None, output_reduction="mean"):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
        ctx.fn, ctx.module, ctx.mask, ctx.tiles = fn, module, mask, _tiles(x.shape[1], shards)
        ctx.reduction = output_reduction
        ctx.save_for_backward(x, y)
        with torch.no_grad():
            losses = [fn(module, *_tile_args(x, y, mask, tile)) for tile in ctx.tiles]
        total = torch.stack(losses).sum()
        return total / len(losses) if output_reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        if ctx.reduction == "mean":
            grad = grad / len(ctx.tiles)
        grad_x = torch.zeros_like(x) if x.requires_grad else None
        for tile in ctx.tiles:
            piece, target, *rest = _tile_args(x, y, ctx.mask, tile)
            piece = _detached(piece, x.requires_grad)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, piece, target, *rest)
            torch.autograd.backward(loss, grad)
            if grad_x is not None:
                grad_x[:, tile] = piece.grad
        return None, None, grad_x, None, None, None, None, None


def _tile_args(x, y, mask, tile) -> list:
    return [x[:, tile], y[:, tile]] + ([] if mask is None else [mask[:, tile]])
