"""FLOP formulas for ops that ``torch.utils.flop_counter``'s registry lacks.

[Note: CPU attention kernels]
On CPU, ``F.scaled_dot_product_attention`` runs the fused kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), which
PyTorch's FLOP registry does not list, so ``FlopCounterMode`` would count attention as
zero. They get the formulas the registry uses for the CUDA attention kernels (two
matmuls forward; five backward, the scores being recomputed), so a model counts the
same FLOPs on either device. An op the installed torch already registers keeps torch's
formula.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

aten = torch.ops.aten


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def extra_formulas() -> dict:
    """``custom_mapping`` for ``FlopCounterMode``: see [Note: CPU attention kernels]."""
    candidates = {
        "_scaled_dot_product_flash_attention_for_cpu": _cpu_attention,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward,
    }
    formulas = {}
    for name, formula in candidates.items():
        op = getattr(aten, name, None)
        if op is not None and op not in flop_counter.flop_registry:
            formulas[op] = formula
    return formulas
