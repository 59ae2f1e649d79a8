"""A backward in two halves: input gradients now, parameter gradients later.

[Note: split backward]
Zero-bubble schedules run a chunk's backward as ``BackwardInput`` (the gradient w.r.t. the
chunk's input, which the previous stage waits for) and, later, ``BackwardWeight`` (the
parameter gradients, which nobody waits for). Both halves run on the autograd graph the
forward recorded; nothing is recomputed.

The input half asks autograd for the input gradients only (``torch.autograd.grad`` with
``inputs=``), keeping the graph. Autograd then runs only the nodes on paths from the
outputs to the inputs, and a node that also has a parameter behind it (a linear layer's
matmul, a layer norm) computes only its input-side result. Those nodes are the
*junctions*: the nodes on an output-to-input path that a parameter's own path (through
casts, transposes, a tied weight's capture) reaches first. A hook on each junction keeps
the gradient arriving at it.

The weight half starts from the junctions with their kept gradients and asks for the
parameters (``torch.autograd.backward`` with ``inputs=``, so the gradients accumulate into
``.grad`` and the ZeRO strategies' accumulation hooks fire as in a whole backward). It runs
once per *group* (the parameters sharing junctions): a single call for all groups would
let a junction's input-side edge lead to another group's parameter, and autograd would
compute that input-side matmul again. When a group has several junctions, one may sit
below another; a hook then gives each junction its kept gradient in place of what arrives
from above, so nothing is counted twice.

Outputs that do not depend on the input (none do on the first stage, whose input is token
ids) keep their gradients for the weight half, which runs their whole backward.
Activation checkpointing is not split (its recompute hides the parameters from the
outer graph): the engine runs such a chunk's backward whole at ``BackwardInput``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The node that receives ``tensor``'s gradient: its ``grad_fn``, or for a leaf its
    gradient accumulator; None when it needs no gradient."""
    if tensor.grad_fn is None and not tensor.requires_grad:
        return None
    return get_gradient_edge(tensor).node


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """For every node below ``roots``, the nodes whose gradients flow into it."""
    consumers: dict[Node, list[Node]] = collections.defaultdict(list)
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _upward(starts, consumers, stop: set[Node] | frozenset = frozenset()) -> tuple[set[Node], list[Node]]:
    """Nodes reached from ``starts`` toward the outputs, not entering ``stop``; and the
    ``stop`` nodes met on the way, in the order met."""
    reached, met = set(starts), {}
    queue = collections.deque(starts)
    while queue:
        for up in consumers.get(queue.popleft(), ()):
            if up in stop:
                met[up] = None
            elif up not in reached:
                reached.add(up)
                queue.append(up)
    return reached, list(met)


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]
    junctions: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)


@dataclass
class WeightHalf:
    """What the input half leaves for the weight half of one micro-batch's backward."""

    groups: list[_Group]
    rest: list[tuple[torch.Tensor, torch.Tensor | None]]
    """Outputs that do not depend on the input, with their gradients (whole backward)."""

    def run(self) -> None:
        """Accumulate the parameter gradients; frees the kept graph."""
        for group in self.groups:
            edges, grads = [], []
            for node in group.junctions:
                for index, grad in enumerate(group.grads.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue
            handles = []
            if len(group.junctions) > 1:  # a junction below another takes its kept gradient only
                for node in group.junctions:
                    kept = group.grads.get(node)
                    if kept is not None:
                        handles.append(node.register_prehook(lambda _, kept=kept: kept))
            try:
                torch.autograd.backward(edges, grads, inputs=group.params, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()
        if self.rest:
            torch.autograd.backward([t for t, _ in self.rest], [g for _, g in self.rest])
        self.groups, self.rest = [], []


def backward_input(
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    params: list[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightHalf]:
    """The input half of the backward of ``outputs`` (with output gradients ``grads``;
    None for a scalar loss) through a chunk with leaf ``inputs`` and parameters
    ``params``: returns the gradients w.r.t. ``inputs`` (None where unused) and the
    weight half, which accumulates the parameters' gradients when run. See [Note: split
    backward]."""
    roots = [_node_of(t) for t in outputs]
    consumers = _consumers(roots)
    input_nodes = [n for n in (_node_of(t) for t in inputs) if n is not None and n in consumers]
    on_input_path, _ = _upward(input_nodes, consumers)
    live = [i for i, node in enumerate(roots) if node in on_input_path]
    rest = [(outputs[i], grads[i]) for i, node in enumerate(roots) if node not in on_input_path]

    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    for param in params:
        node = _node_of(param)
        if node is None or node not in consumers:  # not used by this micro-batch's outputs
            continue
        _, junctions = _upward([node], consumers, stop=on_input_path)
        owners = {id(group_of[j]): group_of[j] for j in junctions if j in group_of}
        group = _Group([param], [j for j in junctions if j not in group_of])
        for other in owners.values():  # a junction shared with earlier parameters: one group
            group.params += other.params
            group.junctions += other.junctions
            groups.remove(other)
        for junction in group.junctions:
            group_of[junction] = group
        if group.junctions:
            groups.append(group)

    handles = []
    for junction, group in group_of.items():

        def keep(grad_outputs, junction=junction, group=group):
            group.grads[junction] = grad_outputs

        handles.append(junction.register_prehook(keep))
    try:
        input_grads: list[torch.Tensor | None] = [None] * len(inputs)
        wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
        if live and wanted:
            found = torch.autograd.grad(
                [outputs[i] for i in live],
                [inputs[i] for i in wanted],
                grad_outputs=[grads[i] for i in live],
                retain_graph=True,
                allow_unused=True,
            )
            for i, grad in zip(wanted, found):
                input_grads[i] = grad
    finally:
        for handle in handles:
            handle.remove()
    return input_grads, WeightHalf(groups, rest)
