"""ALST's tiled compute: a function of a long sequence run in tiles, so only one tile's
intermediate activations exist at a time.

[Note: tiled compute]
Forward runs ``fn`` on each tile of the sequence without recording the graph and keeps only
the inputs; backward runs ``fn`` again on one tile at a time with the graph, back-propagates
that tile's share of the incoming gradient (into the parameters, through autograd, so ZeRO's
gradient hooks see them as usual), and assembles the inputs' gradient. The cost is a second
forward of ``fn``; the memory of its intermediates (an MLP's ``[b, s, 4h]``, the logits
``[b, s, vocab]``) drops to one tile's.

[Note: tiled compute under checkpointing]
Inside an activation-checkpointed block (Hugging Face's decoder layer), backward first runs
the block's forward again to recover what it saved; torch's non-reentrant checkpoint stops
that recomputation as soon as the last saved tensor is packed. ``TiledMLP`` saves only its
input, and in a Llama layer it is the block's last saver (the residual add after it saves
nothing), so its output in the recomputation is thrown away before anyone reads it, and its
own backward recomputes the MLP tile by tile anyway. So when ``TiledMLP.forward`` finds
itself in a recomputation that ends with its own saved input (the checkpoint's counters, read
through torch's saved-tensor hooks), it returns an uninitialized tensor of the output's shape
instead of running the MLP: one of the MLP's three forwards per step is saved (DeepSpeed's
runs all three). Anywhere else (a later op of the block saves something, early stop off,
another version of torch's checkpoint) it computes as usual.

A ``"mean"`` reduction averages over every element of the assembled output (DeepSpeed's
divides the gradient by the number of tiles whatever the output's size).

[Note: the tiled loss's gradients]
A loss is a scalar, so its gradients are known in forward up to the one number backward
brings. ``TiledFusedLogitsLoss`` therefore differentiates each tile's loss in forward
(``torch.autograd.grad``, for the input and for every leaf the tile's graph reaches: the LM
head's weight and bias, whatever ``fn`` uses), frees the tile's logits, and keeps the
summed gradients. Backward multiplies them by the incoming gradient, so a scale applied to
the loss later (accumulation, loss scaling) reaches every one of them; DeepSpeed's runs the
same backward in forward but scales only the input's gradient, so its parameters miss that
scale. The ``compute_params`` are inputs of the autograd function and get their gradients as
its outputs, inside the model's backward, once per backward: ZeRO's gradient hooks fire for
them as for any parameter. Leaves ``fn`` reaches outside ``compute_params`` get theirs by a
``torch.autograd.backward`` from inside that backward.

Memory: besides one tile's logits, forward keeps an input-sized gradient and one buffer the
size of each parameter it differentiates (the LM head's weight: ``vocab x hidden``) until
backward. Under ZeRO-3 a parameter is whole only while its module runs, so there forward
computes the losses alone (no graph), and backward runs the head again tile by tile and
differentiates it the same way (a second forward of the head, and the same buffers, only
during backward).
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
            if _recomputation_ends_here(saving=1):  # see [Note: tiled compute under checkpointing]
                empty = fn(module, x[:, :0])
                return empty.new_empty(empty.shape[:1] + x.shape[1:2] + empty.shape[2:])
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
    gradients are computed tile by tile in forward and scaled in backward (see
    [Note: the tiled loss's gradients]); ``compute_params`` (the parameters ``fn`` uses, say
    ``[self.weight]``) are inputs of the autograd function, so their gradients arrive in the
    model's backward as any other parameter's."""

    @classmethod
    def apply(cls, fn, module, x, y, mask, shards, compute_params=None, output_reduction="mean"):
        params = [p for p in (compute_params or ()) if torch.is_tensor(p)]
        return super().apply(fn, module, x, y, mask, shards, output_reduction, *params)

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, output_reduction, *params):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
        ctx.fn, ctx.module, ctx.mask, ctx.tiles = fn, module, mask, _tiles(x.shape[1], shards)
        ctx.reduction, ctx.params = output_reduction, params
        ctx.recompute = _zero3_managed(module, params)
        if ctx.recompute:
            ctx.save_for_backward(x, y)
            with torch.no_grad():
                losses = [fn(module, *_tile_args(x, y, mask, tile)) for tile in ctx.tiles]
        else:
            losses = _differentiate_tiles(ctx, x, y)
        total = torch.stack(losses).sum()
        return total / len(losses) if output_reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduction == "mean":
            grad = grad / len(ctx.tiles)
        if ctx.recompute:
            x, y = ctx.saved_tensors
            _differentiate_tiles(ctx, x, y)
        by_id = {id(leaf): g for leaf, g in zip(ctx.leaves, ctx.leaf_grads)}
        param_grads = [by_id.pop(id(p), None) for p in ctx.params]
        param_grads = [None if g is None else g.mul_(grad) for g in param_grads]
        others = [leaf for leaf in ctx.leaves if id(leaf) in by_id]
        if others:  # leaves fn reaches outside compute_params
            torch.autograd.backward(others, [by_id[id(leaf)].mul_(grad) for leaf in others])
        grad_x = None if ctx.grad_x is None else ctx.grad_x.mul_(grad)
        ctx.leaves = ctx.leaf_grads = ctx.grad_x = ctx.params = None
        return (None, None, grad_x, None, None, None, None, *param_grads)


def _recomputation_ends_here(saving: int) -> bool:
    """Whether this call runs inside the recomputation of a non-reentrant checkpoint that
    stops as soon as the ``saving`` tensors this call saves for backward are packed (see
    [Note: tiled compute under checkpointing]); False whenever that cannot be told."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack = getattr(hooks[0], "__wrapped__", None) if hooks else None
        if pack is None or not pack.__qualname__.startswith("_recomputation_hook."):
            return False
        cells = dict(zip(pack.__code__.co_freevars, (cell.cell_contents for cell in pack.__closure__)))
        frame, gid = cells["target_frame_ref"](), cells["gid"]
        return bool(frame.early_stop) and frame.recomp_counter[gid] + saving == len(frame.weak_holders)
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):  # other internals: compute
        return False


def _zero3_managed(module, compute_params) -> bool:
    """Whether any parameter the loss may use is ZeRO-3's (whole only inside its forward)."""
    params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    return any(hasattr(p, "ds_shape") for p in params + list(compute_params or ()))


def _differentiate_tiles(ctx, x, y) -> list[Tensor]:
    """Each tile's loss and its gradients, summed over the tiles into ``ctx.grad_x`` and
    ``ctx.leaf_grads`` (one per leaf in ``ctx.leaves``); only one tile's logits live at a
    time."""
    ctx.grad_x = torch.zeros_like(x) if x.requires_grad else None
    ctx.leaves, ctx.leaf_grads = [], []
    losses = []
    for tile in ctx.tiles:
        piece, target, *rest = _tile_args(x, y, ctx.mask, tile)
        piece = _detached(piece, x.requires_grad)
        with torch.enable_grad():
            loss = ctx.fn(ctx.module, piece, target, *rest)
            leaves = _graph_leaves(loss, exclude=piece)
            if not ctx.leaf_grads:
                ctx.leaves = leaves
            elif [id(t) for t in leaves] != [id(t) for t in ctx.leaves]:
                raise RuntimeError("TiledFusedLogitsLoss: fn used different parameters on different tiles")
            wanted = ([piece] if x.requires_grad else []) + leaves
            grads = torch.autograd.grad(loss, wanted) if wanted else ()
        if x.requires_grad:
            ctx.grad_x[:, tile] = grads[0]
            grads = grads[1:]
        if ctx.leaf_grads:
            ctx.leaf_grads = [a.add_(b) for a, b in zip(ctx.leaf_grads, grads)]
        else:
            ctx.leaf_grads = [g.clone() for g in grads]  # owned: later tiles add into them
        losses.append(loss.detach())
    return losses


def _graph_leaves(output: Tensor, *, exclude: Tensor) -> list[Tensor]:
    """The tensors requiring a gradient that ``output`` was computed from (its graph's
    ``AccumulateGrad`` nodes), in a fixed order, without ``exclude``."""
    leaves, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            if variable is not exclude:
                leaves.append(variable)
            continue
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def _tile_args(x, y, mask, tile) -> list:
    return [x[:, tile], y[:, tile]] + ([] if mask is None else [mask[:, tile]])
