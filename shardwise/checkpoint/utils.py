"""DeepSpeed's ``deepspeed.checkpoint.utils`` helper for saving tensors with ``torch.save``."""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``item`` with every tensor (through lists, tuples and dicts) replaced by a detached
    copy on ``device``, so ``torch.save`` writes each tensor's own elements, not the whole
    (possibly flat, shared) storage it is a view of."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
