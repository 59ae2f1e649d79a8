"""Measured layer costs for ``PipelineModule(partition_method="profile")``.

[Note: profiled partition]
The stage that bounds a pipeline's step is the one with the most forward + backward time
per micro-batch, and parameter counts predict that badly: an embedding has many
parameters and costs a lookup; an output head's matmul and the loss over the vocabulary
cost more than their share; attention costs time without parameters. So ``"profile"``
times each layer's forward and backward on a sample micro-batch the user gives
(``partition_sample=(inputs, labels)``, what ``train_batch``'s iterator yields), before
any stage is built, and cuts with ``partition_min_max`` (the slowest stage as light as it
can be, see [Note: two balancing objectives] in ``_partition.py``).

- One layer at a time: a layer is built, timed and dropped before the next is built (tied
  layers are built once and reused), so no rank holds more than one layer beyond its
  stage's; each layer runs on the previous layer's output, detached, so its backward
  computes exactly its own gradients (input and parameters, through
  ``torch.autograd.grad``: nothing accumulates into ``.grad``). The loss runs with the
  last layer and counts as its cost.
- Every rank measures every layer (at once, so each sees the load training will put on
  the machine) and the per-layer times (each the fastest of ``TIMED_RUNS``) are averaged over all ranks from one
  ``all_gather``, in rank order: every rank computes the same floats, hence the same
  boundaries.
- Nothing leaks into training: the random state is restored afterwards (building and
  dropout draw from it) and the buffers of modules passed in built (a BatchNorm's running
  statistics) are put back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from shardwise.pipe._errors import PipelineError

TIMED_RUNS = 3
"""Timed forward + backward runs per layer (after one untimed run); the fastest counts (on a
shared machine other work only ever adds time, and the layers are timed at different moments)."""


def check_sample(sample) -> None:
    """Refuse a ``partition_sample`` that is not one ``(inputs, labels)`` micro-batch."""
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise PipelineError(
            "partition_sample must be one micro-batch as train_batch's iterator yields it, an "
            f"(inputs, labels) pair; got {type(sample).__name__}"
        )
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(sample[0])):
        raise PipelineError("partition_sample's inputs hold no tensor to run the layers on")


def sample_device(sample) -> torch.device:
    """The device of the sample's first input tensor: the layers are timed there."""
    return next(t for t in tree_leaves(sample[0]) if isinstance(t, torch.Tensor)).device


def layer_costs(build: Callable[[int], Callable], num_layers: int, sample, *, loss_fn=None) -> list[float]:
    """Seconds of forward + backward of layers ``0 .. num_layers - 1`` (``build(i)`` makes
    layer ``i``'s call, when it is timed), run in order from ``sample``'s inputs; the loss
    (``loss_fn(outputs, labels)``) is added to the last layer's. See [Note: profiled
    partition]."""
    inputs, labels = sample
    device = sample_device(sample)
    costs: list[float] = []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        x = inputs
        for index in range(num_layers):
            last = index == num_layers - 1
            cost, x = _time_layer(build(index), x, (loss_fn, labels) if last and loss_fn is not None else None, device)
            costs.append(cost)
    return costs


def _time_layer(call: Callable, x, loss, device: torch.device) -> tuple[float, object]:
    """The fewest seconds of ``call``'s forward + backward on ``x`` (and the loss, if given),
    and its output, detached."""
    inputs = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, x)
    params = [p for m in _modules_of(call) for p in m.parameters() if p.requires_grad]
    saved = [(b, b.detach().clone()) for m in _modules_of(call) for b in m.buffers()]
    times, out = [], None
    for run in range(TIMED_RUNS + 1):
        _synchronize(device)
        start = time.perf_counter()
        out = call(inputs)
        roots = [loss[0](out, loss[1])] if loss is not None else _grad_outputs_of(out)
        wrt = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad] + params
        if roots and wrt:  # one scalar root: ones as every output's gradient
            torch.autograd.grad(sum(r.sum() for r in roots), wrt, allow_unused=True)
        _synchronize(device)
        if run:
            times.append(time.perf_counter() - start)
    with torch.no_grad():
        for buffer, value in saved:
            buffer.copy_(value)
    return min(times), tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _grad_outputs_of(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _modules_of(call: Callable) -> list[nn.Module]:
    """The modules whose parameters ``call`` uses: itself, or those bound into a
    ``functools.partial`` (a tied layer's ``forward_fn``)."""
    if isinstance(call, nn.Module):
        return [call]
    return [a for a in getattr(call, "args", ()) if isinstance(a, nn.Module)]


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
