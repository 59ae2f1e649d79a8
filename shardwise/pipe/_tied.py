"""Tied weights across pipeline stages: their gradients kept aside, summed, fed once.

[Note: tied weights in a pipeline]
Tied weights (``TiedLayerSpec``) are used on several stages. Their gradients must be
summed across those stages before the optimizer sees them, but a stage cannot wait for
another inside its backward without stalling the schedule. So each stage routes a tied
weight through :class:`_CaptureGrad`, which keeps that weight's gradient aside instead
of giving it to the parameter; after the last micro-batch the kept gradients are summed
over the stages holding the weight and fed to the parameter in one extra backward, which
is then the accumulation boundary. Every copy gets the same gradient, so they stay equal;
the global norm counts each copy ``1 / copies`` (see [Note: the global norm over the
grid] in ``zero/_strategy.py``).
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

import torch
from torch.utils._pytree import tree_flatten

from shardwise.pipe.module import PipelineModule
from shardwise.zero import GatheredParameters


class TiedWeights:
    """This stage's tied weights shared with other stages, and their kept gradients."""

    def __init__(self, module: PipelineModule, *, timeout_s: float):
        """Mark every tied weight with its copy count and key (read by the ZeRO strategies)
        and route each use of it on this stage through :class:`_CaptureGrad`."""
        self._entries = []
        for key, param, ranks, comm in module.tied_weights():  # the module made the copies equal
            comm.timeout = timedelta(seconds=timeout_s)
            param.pipe_copies = len(ranks)
            param.pipe_tied_key = key
            self._entries.append((key, param, comm, {"grad": None}))
        self._install(module)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def _install(self, pipe_module: PipelineModule) -> None:
        for key, param, _, store in self._entries:
            module = pipe_module.tied_modules[key]
            name = next(n for n, p in module.named_parameters() if p is param)
            owner, attr = _owner(module, name)
            for funcs in pipe_module.chunk_funcs.values():
                for index, fn in enumerate(funcs):
                    if fn is module or (isinstance(fn, partial) and fn.args and fn.args[0] is module):
                        funcs[index] = _CapturedCall(fn, owner, attr, store)

    def feed_gradients(self, strategy) -> None:
        """Sum the kept gradients over the stages holding each weight and give them to the
        parameters in one backward through ``strategy``, the accumulation boundary (see
        [Note: tied weights in a pipeline])."""
        outputs, grads = [], []
        with GatheredParameters([param for _, param, _, _ in self._entries]):  # whole under stage 3
            for key, param, comm, store in self._entries:
                grad = store["grad"] if store["grad"] is not None else torch.zeros_like(param)
                store["grad"] = None
                comm.all_reduce(grad, tag=f"tied weight {key} gradient").wait()
                outputs.append(param * 1.0)
                grads.append(grad)
            strategy.pre_backward(boundary=True, sync=True)
            torch.autograd.backward(outputs, grads)
            strategy.finalize_backward()


class _CaptureGrad(torch.autograd.Function):
    """Identity forward; backward adds the gradient to ``store`` and passes zeros on (so
    the parameter's gradient hooks, which the ZeRO strategies count on, still fire)."""

    @staticmethod
    def forward(ctx, weight, store):
        ctx.store = store
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        store = ctx.store
        store["grad"] = grad.detach().clone() if store.get("grad") is None else store["grad"] + grad
        return torch.zeros_like(grad), None


def _owner(module: torch.nn.Module, dotted: str):
    *path, name = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


class _CapturedCall:
    """Call ``fn`` with ``owner.<attr>`` seen as ``_CaptureGrad(param)`` for the call."""

    def __init__(self, fn, owner: torch.nn.Module, attr: str, store: dict):
        self.fn, self.owner, self.attr, self.store = fn, owner, attr, store

    def __call__(self, x):
        param = self.owner._parameters[self.attr]
        # under ZeRO stage 3 the weight is gathered before the capture reads it (the module's
        # own pre-forward hook would gather it only inside fn); its backward gathers it again
        with GatheredParameters([param]):
            del self.owner._parameters[self.attr]
            try:
                self.owner.__dict__[self.attr] = _CaptureGrad.apply(param, self.store)
                out = self.fn(x)
            finally:
                self.owner.__dict__.pop(self.attr, None)
                self.owner._parameters[self.attr] = param
        owner = getattr(param, "_shardwise_unit", None)
        if owner is not None:  # a forward_fn need not call the module, whose hooks would gather it for backward
            strategy, unit = owner
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(_gather_first(strategy, unit))
        return out


def _gather_first(strategy, unit):
    """A gradient hook that gathers ``unit`` (stage 3) before the backward that reads it."""

    def hook(grad):
        strategy.gather_units([unit])
        return grad

    return hook
