"""Every local expert in one grouped matmul per linear layer.

[Note: grouped experts]
``_dispatch.py`` hands the local experts one buffer of rows grouped by expert (``counts[i]``
rows for expert ``i``). Running each expert module on its slice costs one matmul launch,
and a Python call, per expert and layer. When the experts are copies of one module built
from linear layers and row-wise functions (``Linear -> GELU -> Linear``, a SwiGLU
``w2(silu(w1(x)) * w3(x))``), the whole buffer can go through the graph once instead:

- each ``nn.Linear`` becomes one ``torch._grouped_mm`` of the buffer with the experts'
  weights stacked ``[E, out, in]`` (group ``i`` = expert ``i``'s rows); its bias is added
  as ``one_hot(expert of row) @ biases[E, out]`` (one ``addmm``, whose backward sums each
  expert's rows in a matmul rather than with atomic adds onto ``E`` rows);
- every other node is a function of single rows (activations, dropout, arithmetic, a split
  of the last dimension), so it runs on all rows at once.

The plan comes from tracing each expert with ``torch.fx``; the experts must trace to the
same graph (same code, constants and submodule ``repr``), or the layer keeps running them
one by one (``run_each``), as it does for anything else: control flow, parameters used
outside an ``nn.Linear``, hooks on an expert, mixed dtypes, a device and dtype whose
``_grouped_mm`` fails a small probe, or dimensions the kernel cannot align (16 bytes). The
stacked weights are built from the expert parameters by ``torch.stack``, so gradients
reach every expert's own parameters (zero for an expert without rows), and names, state
dicts and ZeRO see nothing new.

The layer takes this path for bf16 on CUDA only (``FAST_ON``), where torch has a grouped
kernel (CUTLASS, sm90): on an H100, one MoE layer (8 experts, 4x MLP, top-2, forward and
backward) took 5.7 ms grouped against 12.1 ms one call per expert (4096 tokens, hidden
256) and 11.9 against 14.8 ms (32768 tokens, hidden 1024). In fp32 the GPU's
``_grouped_mm`` is slower than the loop (8.1 against 7.1 ms, 8192 tokens, hidden 512), and
torch's CPU one is a loop of matmuls over transposed weights that, with the stacking and
the bias, measured 1.4x slower than one call per expert (2048 tokens, hidden 256, fp32,
one thread: forward 67 ms against 45 ms).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

logger = logging.getLogger(__name__)

_ROWWISE_MODULES = (
    nn.GELU,
    nn.ReLU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Identity,
    nn.Dropout,
    nn.LeakyReLU,
    nn.Mish,
    nn.Softplus,
    nn.ELU,
)
_ROWWISE_FUNCTIONS = {
    F.gelu,
    F.relu,
    F.silu,
    F.mish,
    F.softplus,
    F.elu,
    F.leaky_relu,
    F.dropout,
    torch.tanh,
    torch.sigmoid,
    torch.relu,
    torch.mul,
    torch.add,
    operator.mul,
    operator.add,
    operator.sub,
    operator.truediv,
    operator.neg,
}
_ROWWISE_METHODS = {"mul", "add", "sub", "div", "neg", "sigmoid", "tanh", "relu", "contiguous"}
_LAST_DIM_SPLITS = {torch.chunk, torch.split, "chunk", "split"}


def _is_rowwise(node: fx.Node, module: nn.Module) -> bool:
    if node.op == "call_module":
        return isinstance(module.get_submodule(node.target), _ROWWISE_MODULES)
    if node.op in ("call_function", "call_method") and node.target in _LAST_DIM_SPLITS:
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        return dim in (-1, 1)  # the rows are [T, M]: dim 1 is the last one
    if node.op == "call_function" and node.target is operator.getitem:
        return isinstance(node.args[1], int) and node.args[0].target in _LAST_DIM_SPLITS
    if node.op == "call_function":
        return node.target in _ROWWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ROWWISE_METHODS


def _trace(expert: nn.Module) -> fx.GraphModule | None:
    try:
        graph = fx.symbolic_trace(expert)
    except Exception:  # noqa: BLE001 - user code may raise anything under tracing: run it as it is
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return None
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_module" and type(graph.get_submodule(node.target)) is nn.Linear:
            if len(node.args) != 1 or node.kwargs:
                return None
        elif not _is_rowwise(node, graph):
            return None
    output = next(n for n in graph.graph.nodes if n.op == "output")
    return graph if isinstance(output.args[0], fx.Node) else None


def _signature(graph: fx.GraphModule) -> str:
    modules = [f"{n.target}: {graph.get_submodule(n.target)!r}" for n in graph.graph.nodes if n.op == "call_module"]
    return str(graph.graph) + "\n".join(modules)


FAST_ON = {("cuda", torch.bfloat16)}
"""(device type, dtype) pairs where the MoE layer runs qualifying experts grouped."""

_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on ``device`` in ``dtype``
    and agrees with one matmul per group (probed once per device type and dtype)."""
    key = (device.type, dtype)
    if key not in _PROBED:
        _PROBED[key] = _probe(device, dtype)
    return _PROBED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(24, 16, generator=gen).to(device, dtype).requires_grad_()
    weight = torch.randn(3, 32, 16, generator=gen).to(device, dtype).requires_grad_()
    bias = torch.randn(3, 32, generator=gen).to(device, dtype).requires_grad_()
    counts = [8, 0, 16]
    try:
        got = _grouped_linear(rows, weight, bias, _Groups(counts, device))
        got.backward(torch.ones_like(got))
    except (RuntimeError, NotImplementedError) as error:
        logger.debug("torch._grouped_mm unusable on %s in %s: %s", device.type, dtype, error)
        return False
    pieces = zip(rows.detach().split(counts), weight.detach(), bias.detach())
    expected = torch.cat([piece @ w.t() + b for piece, w, b in pieces])
    return bool(torch.allclose(got.detach().float(), expected.float(), rtol=2e-2, atol=2e-2))


class _Groups:
    """One call's group sizes on the device, copied once (no wait for the GPU's queue):
    ``lengths``, the kernel's int32 end ``offsets`` and, on demand, each row's expert as a
    one-hot ``[rows, E]`` matrix."""

    def __init__(self, counts: list[int], device: torch.device):
        lengths = torch.tensor(counts, dtype=torch.int64)
        if device.type == "cuda":
            lengths = lengths.pin_memory()
        self.lengths = lengths.to(device, non_blocking=True)
        self.offsets = self.lengths.cumsum(0).to(torch.int32)
        self.rows = sum(counts)
        self._one_hot: dict[torch.dtype, torch.Tensor] = {}

    def one_hot(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, E]: 1 at each row's expert."""
        if dtype not in self._one_hot:
            experts = torch.arange(self.lengths.numel(), device=self.lengths.device)
            row_expert = torch.repeat_interleave(experts, self.lengths, output_size=self.rows)
            one_hot = torch.zeros(self.rows, self.lengths.numel(), dtype=dtype, device=row_expert.device)
            self._one_hot[dtype] = one_hot.scatter_(1, row_expert.unsqueeze(1), 1)  # F.one_hot would sync
        return self._one_hot[dtype]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous
    (``_grouped_mm``'s backward refuses an expanded one, such as ``sum()``'s)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_linear(rows, weight, bias, groups: _Groups) -> torch.Tensor:
    """``rows @ weight[i].T (+ bias[i])`` on each group ``i`` of ``rows``."""
    out = _ContiguousGrad.apply(torch._grouped_mm(rows, weight.transpose(-2, -1), offs=groups.offsets))
    if bias is not None:  # out + bias[expert of row]; its backward sums each expert's rows in one matmul
        out = torch.addmm(out, groups.one_hot(out.dtype), bias)
    return out


class GroupedExperts:
    """Runs ``experts`` (copies of one module) on rows grouped by expert with one grouped
    matmul per ``nn.Linear`` (see [Note: grouped experts]); :meth:`plan` returns None where
    the experts do not qualify."""

    def __init__(self, experts: list[nn.Module], graph: fx.GraphModule):
        self.experts = experts
        self.graph = graph
        modules = [n.target for n in graph.graph.nodes if n.op == "call_module"]
        self.linears = {target for target in modules if type(graph.get_submodule(target)) is nn.Linear}

    @classmethod
    def plan(cls, experts: list[nn.Module]) -> GroupedExperts | None:
        if not experts or not hasattr(torch, "_grouped_mm"):
            return None
        graphs = [_trace(expert) for expert in experts]
        if any(g is None for g in graphs) or len({_signature(g) for g in graphs}) != 1:
            return None
        return cls(experts, graphs[0])

    def usable(self, rows: torch.Tensor) -> bool:
        """Whether these rows can take the grouped path now (else run each expert)."""
        if rows.shape[0] == 0 or torch.nn.modules.module._global_forward_hooks:
            return False
        element = rows.element_size()
        for expert in self.experts:
            for module in expert.modules():
                if module._forward_hooks or module._forward_pre_hooks:
                    return False
            for target in self.linears:
                linear = expert.get_submodule(target)
                if linear.weight.dtype != rows.dtype or linear.weight.device != rows.device:
                    return False
                if (linear.in_features * element) % 16 or (linear.out_features * element) % 16:
                    return False
        return grouped_mm_works(rows.device, rows.dtype)

    def __call__(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        groups = _Groups(counts, rows.device)
        values: dict[fx.Node, object] = {}

        def value(arg):
            return fx.node.map_arg(arg, lambda n: values[n])

        for node in self.graph.graph.nodes:
            if node.op == "placeholder":
                values[node] = rows
            elif node.op == "output":
                return values[node.args[0]]
            elif node.op == "call_module" and node.target in self.linears:
                linears = [expert.get_submodule(node.target) for expert in self.experts]
                weight = torch.stack([linear.weight for linear in linears])
                bias = None if linears[0].bias is None else torch.stack([linear.bias for linear in linears])
                values[node] = _grouped_linear(value(node.args[0]), weight, bias, groups)
            elif node.op == "call_module":
                values[node] = self.experts[0].get_submodule(node.target)(*value(node.args), **value(node.kwargs))
            elif node.op == "call_method":
                first, *rest = value(node.args)
                values[node] = getattr(first, node.target)(*rest, **value(node.kwargs))
            else:
                values[node] = node.target(*value(node.args), **value(node.kwargs))
        raise AssertionError("an fx graph ends in an output node")
