"""Attention outputs kept through activation checkpointing's recompute (opt-in).

[Note: kept attention outputs]
Under activation checkpointing a layer runs forward twice: once in the forward pass, with
its saved tensors dropped, and once more in backward to recreate them. Attention is the
largest part of that recompute at long sequences (on 2 CPU ranks at 4096 tokens, 8 of the
16 flash-attention forwards of a step, about 9% of its time), and its output is all the
recompute needs from it: the backward of flash attention takes the inputs, the output and
the log-sum-exp, and the layer's later operations take the output.

With ``keep_attention_outputs`` the attention of a sequence-parallel layer runs through
:class:`_FlashAttention`, which keeps the output and log-sum-exp of its first run on its own
autograd node (where the checkpoint's saved-tensor hooks do not drop them) and lists them,
weakly, under the attention module. When the recompute calls it again with the same
inputs, it hands back the kept tensors instead of running the kernel; the kept tensors live
exactly as long as the forward's graph (a forward whose backward never runs keeps nothing
alive after its graph is freed).

"The same inputs" is checked, not assumed: each kept run records a fingerprint of its
query, key and value (sums, and row and column sums weighted by position), and a call uses a kept output
only when the fingerprints are equal, so several forwards in flight for one module (pipeline
micro-batches, gradient accumulation) each find their own, and a recompute that differs
from its forward (a kernel that is not bitwise reproducible) runs the kernel again. A
fingerprint can only mistake two inputs for one another when three weighted sums of each of
them agree exactly, which different activations do not.

The price is memory: each checkpointed layer keeps one attention output (the size of its
input checkpoint) and the log-sum-exp from its forward until its backward, roughly doubling
what checkpointing stores per layer. That is why it is off by default: at the longest
sequence that fits, the layer inputs are what checkpointing keeps, and doubling them can cost
the length. The kernel is PyTorch's CPU flash attention; other devices, masks, dropout, and
attention functions other than transformers' ``sdpa`` run the original function.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Kept:
    """One forward's attention output and log-sum-exp, and the fingerprint of its inputs."""

    __slots__ = ("__weakref__", "fingerprint", "lse", "out")

    def __init__(self, fingerprint: Tensor, out: Tensor, lse: Tensor) -> None:
        self.fingerprint, self.out, self.lse = fingerprint, out, lse


class KeptAttention:
    """The kept outputs of each attention module's live forwards (weak references: the
    forward's autograd node owns them)."""

    def __init__(self) -> None:
        self._by_module: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref[_Kept]]] = weakref.WeakKeyDictionary()

    def find(self, module: nn.Module, fingerprint: Tensor) -> _Kept | None:
        live = [ref for ref in self._by_module.get(module, ()) if ref() is not None]
        self._by_module[module] = live
        for ref in live:
            kept = ref()
            if kept is not None and torch.equal(kept.fingerprint, fingerprint):
                return kept
        return None

    def add(self, module: nn.Module, kept: _Kept) -> None:
        self._by_module.setdefault(module, []).append(weakref.ref(kept))

    def live(self, module: nn.Module) -> int:
        """How many forwards of ``module`` have kept outputs alive (for tests)."""
        return sum(ref() is not None for ref in self._by_module.get(module, ()))


def fingerprint(*tensors: Tensor) -> Tensor:
    """Each tensor's sum, and its row sums and column sums weighted by position (see [Note:
    kept attention outputs]): two passes over each tensor, whatever its strides."""
    parts = []
    for t in tensors:
        rows = t.sum(dim=-1, dtype=torch.float32).reshape(-1)
        cols = t.sum(dim=tuple(range(t.dim() - 1)), dtype=torch.float32)
        parts += [rows.sum(), rows @ _ramp(rows), cols @ _ramp(cols)]
    return torch.stack(parts)


def _ramp(x: Tensor) -> Tensor:
    return torch.arange(1, x.numel() + 1, dtype=x.dtype, device=x.device).div_(x.numel())


def applies(attn, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, kwargs: dict) -> bool:
    """Whether the call ``attn(module, q, k, v, None, **kwargs)`` is what :func:`attention`
    computes: transformers' ``sdpa`` on the CPU, while training with gradients, without a
    mask, dropout, position bias or soft capping."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return (
        attn is sdpa_attention_forward
        and torch.is_grad_enabled()
        and module.training
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.shape[2] > 1
        and q.shape[2] == k.shape[2]
        and q.shape[1] % k.shape[1] == 0
        and not kwargs.get("dropout")
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions")
    )


def attention(keeper: KeptAttention, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, kwargs: dict) -> Tensor:
    """What transformers' ``sdpa`` returns for ``q, k, v`` (``[b, heads, s, d]``, no mask):
    ``[b, s, heads, d]``, keeping the output through a checkpoint's recompute."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    out = _FlashAttention.apply(q, k, v, kwargs.get("scaling"), bool(causal), keeper, module)
    return out.transpose(1, 2).contiguous()


class _FlashAttention(torch.autograd.Function):
    """CPU flash attention whose output and log-sum-exp outlive a checkpoint's dropped
    tensors (see [Note: kept attention outputs])."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, keeper, module):
        mark = fingerprint(q, k, v)
        kept = keeper.find(module, mark)
        if kept is None:
            out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
            kept = _Kept(mark, out.detach(), lse)
            keeper.add(module, kept)
        ctx.kept = kept  # the node owns the kept tensors; the keeper only points at them
        ctx.scale, ctx.causal = scale, causal
        out = kept.out.detach()
        ctx.save_for_backward(q, k, v, out, kept.lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=None, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None
