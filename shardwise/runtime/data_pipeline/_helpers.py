"""Helpers for models written without the legacy curriculum or layer drop in mind: cut a
batch to the scheduled sequence length, and skip a block with the scheduled keep
probability."""

from __future__ import annotations

import torch
from torch import nn


def truncate_to_curriculum(batch, curriculum_seqlen: int | None, *, dim: int = 1):
    """``batch`` cut to its first ``curriculum_seqlen`` positions along ``dim``, as
    Megatron-style models do with the ``curriculum_seqlen`` the engine passes.

    Every tensor of at least ``dim + 1`` dimensions in ``batch`` (a tensor, or dicts, lists
    and tuples of them, nested) is sliced (a view, no copy); other values are returned as
    they are. ``curriculum_seqlen`` None (an eval forward) leaves the batch whole. A
    tensor whose sequence is not on ``dim`` (a ``[batch, 1, seq, seq]`` attention mask)
    needs its own slicing.
    """
    if curriculum_seqlen is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.narrow(dim, 0, min(curriculum_seqlen, batch.shape[dim])) if batch.dim() > dim else batch
    if isinstance(batch, dict):
        return type(batch)((k, truncate_to_curriculum(v, curriculum_seqlen, dim=dim)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(truncate_to_curriculum(v, curriculum_seqlen, dim=dim) for v in batch)
    return batch


class CurriculumTruncation(nn.Module):
    """Wraps a model whose forward does not take ``curriculum_seqlen``: the wrapper takes
    it and calls the model with every input cut by :func:`truncate_to_curriculum`.

    Args:
        model: the model to wrap (its parameters become the wrapper's, under ``model.``).
        dim: the sequence dimension of the inputs. Default 1 (``[batch, seq, ...]``).
    """

    def __init__(self, model: nn.Module, *, dim: int = 1):
        super().__init__()
        self.model = model
        self.dim = dim

    def forward(self, *inputs, curriculum_seqlen: int | None = None, **kwargs):
        inputs = truncate_to_curriculum(inputs, curriculum_seqlen, dim=self.dim)
        return self.model(*inputs, **truncate_to_curriculum(kwargs, curriculum_seqlen, dim=self.dim))


def layer_keep_probability(theta: float, layer_index: int, num_layers: int) -> float:
    """The probability that block ``layer_index`` (0-based) of ``num_layers`` runs when
    progressive layer drop's keep probability is ``theta``: ``1 - (i + 1) / L * (1 - theta)``,
    so deeper blocks are dropped more often and the last one with ``1 - theta`` (the PLD
    paper's distribution along depth, section 4.2)."""
    if not 0 <= layer_index < num_layers:
        raise ValueError(f"layer_index must be from 0 to {num_layers - 1}, got {layer_index}")
    return 1.0 - (layer_index + 1) / num_layers * (1.0 - theta)


def drop_layer(
    block: nn.Module,
    hidden: torch.Tensor,
    *args,
    theta: float | None,
    layer_index: int,
    num_layers: int,
    generator: torch.Generator | None = None,
    **kwargs,
):
    """Run ``block(hidden, *args, **kwargs)``, or skip it and return ``hidden`` with
    probability ``1 - layer_keep_probability(theta, layer_index, num_layers)`` while
    ``block`` is training. In eval mode, or with ``theta`` None (layer drop off), the block
    always runs. A kept block's output is not rescaled (as DeepSpeed's BERT example).

    One uniform number is drawn per call, from ``generator`` (torch's default CPU
    generator when None). Under ZeRO stage 3 every data-parallel rank must draw the same
    numbers (a skipped block gathers no parameters, so ranks that disagree wait on each
    other): give a generator seeded alike on every rank.
    """
    if theta is None or not block.training:
        return block(hidden, *args, **kwargs)
    keep = layer_keep_probability(theta, layer_index, num_layers)
    if torch.rand((), generator=generator).item() < keep:
        return block(hidden, *args, **kwargs)
    return hidden
