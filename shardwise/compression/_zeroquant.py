"""ZeroQuant post-training quantization: :func:`zeroquant` quantizes a trained model's linear
layers with no training (the ``compression_training`` config's weight and activation
quantization at their final bits from the first forward), then, given calibration batches,
repairs each transformer block with layer-by-layer knowledge distillation
(:func:`layer_by_layer_distillation`).

[Note: layer-by-layer distillation]
ZeroQuant's LKD (DeepSpeed never released it) trains the quantized blocks one at a time.
The fp32 teacher runs once over the calibration batches; for each block ``k`` it records
what block ``k`` received (positional and keyword arguments: hidden states, masks,
positions) and what it returned. The student's block ``k`` is then given the teacher's
inputs, not its own quantized predecessors' outputs, and trained on the mean squared error
between its output and the teacher block's, with only its own parameters trainable
(weights through the straight-through quantizers, biases and norms directly). Blocks are
therefore independent: no error flows from one block into the next one's training, and
memory holds one block's graph at a time plus the recorded activations (blocks x
calibration batches x the hidden states).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config._compression import CompressionConfig

logger = logging.getLogger("shardwise")


@dataclass(frozen=True)
class BlockError:
    """The mean squared error of one student block against its teacher block on the
    calibration batches, before and after distillation."""

    name: str
    before: float
    after: float


def check_post_training(config: CompressionConfig) -> None:
    """Refuse a ``compression_training`` section that does not quantize from the first
    forward at its final bits (what post-training quantization computes).

    Raises:
        ValueError: naming the key to change.
    """
    weights = config.weight_quantization
    if not weights.enabled:
        raise ValueError("zeroquant: compression_training.weight_quantization must be enabled")
    where = "compression_training.weight_quantization"
    if weights.shared["schedule_offset"] != 0:
        raise ValueError(
            f"zeroquant: {where}.shared_parameters.schedule_offset must be 0 for post-training quantization"
        )
    for group in weights.groups:
        params = group.params
        if not weights.shared["quantize_weight_in_forward"] and params["start_bits"] != params["target_bits"]:
            raise ValueError(
                f"zeroquant: {where}.different_groups.{group.name} starts at {params['start_bits']} bits and ends at "
                f"{params['target_bits']} (a QAT schedule); set quantize_weight_in_forward: true or "
                "start_bits = target_bits"
            )
    acts = config.activation_quantization
    if acts.enabled and acts.shared["schedule_offset"] != 0:
        raise ValueError(
            "zeroquant: compression_training.activation_quantization.shared_parameters.schedule_offset must be 0"
        )
    for other in ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning", "layer_reduction"):
        if getattr(config, other).enabled:
            raise ValueError(f"zeroquant: compression_training.{other} needs training; use init_compression for it")


def find_blocks(model: nn.Module, blocks: str | None) -> tuple[str, nn.ModuleList]:
    """``(name, layers)``: the ``nn.ModuleList`` named ``blocks``, or when None the one
    ModuleList whose children all hold linear layers, with the most children.

    Raises:
        ValueError: no such list, or several equally long ones (name one with ``blocks=``).
    """
    if blocks is not None:
        found = dict(model.named_modules()).get(blocks)
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            kind = "no module" if found is None else f"a {type(found).__name__}"
            raise ValueError(f"zeroquant: blocks={blocks!r} names {kind}; name the ModuleList of transformer blocks")
        return blocks, found
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        and len(m) > 0
        and all(any(isinstance(x, nn.Linear) for x in child.modules()) for child in m)
    ]
    if not lists:
        raise ValueError("zeroquant: the model has no ModuleList of blocks with linear layers; pass blocks='name'")
    longest = max(len(m) for _, m in lists)
    best = [(name, m) for name, m in lists if len(m) == longest]
    if len(best) > 1:
        names = ", ".join(name for name, _ in best)
        raise ValueError(f"zeroquant: several ModuleLists could be the blocks ({names}); pass blocks='name'")
    return best[0]


def run_batch(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``. A model whose forward takes ``use_cache`` (Hugging Face) gets
    ``use_cache=False`` unless the batch sets it: a KV cache handed to the blocks would
    be recorded and grow each time a block is replayed."""
    extra = {}
    if "use_cache" in inspect.signature(model.forward).parameters:
        extra = {"use_cache": False}
    if isinstance(batch, Mapping):
        return model(**{**extra, **batch})
    if isinstance(batch, (tuple, list)):
        return model(*batch, **extra)
    return model(batch, **extra)


def _first_tensor(output: Any) -> torch.Tensor:
    while not isinstance(output, torch.Tensor):
        if isinstance(output, (tuple, list)) and output:
            output = output[0]
        elif hasattr(output, "to_tuple"):
            output = output.to_tuple()[0]
        else:
            raise ValueError(f"zeroquant: a block returned {type(output).__name__}, with no tensor to distill")
    return output


@torch.no_grad()
def _record(teacher: nn.Module, layers: nn.ModuleList, calibration: list) -> list[list[tuple]]:
    """For each block, ``(args, kwargs, output)`` per calibration batch (see
    [Note: layer-by-layer distillation])."""
    records: list[list[tuple]] = [[] for _ in layers]

    def hook(index):
        def save(module, args, kwargs, output):
            records[index].append((args, kwargs, _first_tensor(output).detach()))

        return save

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for batch in calibration:
            run_batch(teacher, batch)
    finally:
        for handle in handles:
            handle.remove()
    return records


def _block_error(block: nn.Module, records: list[tuple]) -> float:
    with torch.no_grad():
        losses = [F.mse_loss(_first_tensor(block(*a, **k)), target).item() for a, k, target in records]
    return sum(losses) / len(losses)


def _distill_block(block: nn.Module, records: list[tuple], *, steps: int, lr: float) -> None:
    """Adam on the block's floating-point parameters (written out: ``torch.optim`` would
    import ``torch._dynamo``, seconds on a small machine, for a few hundred updates)."""
    params = [p for p in block.parameters() if p.is_floating_point()]
    saved = [p.requires_grad for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for p in params:
        p.requires_grad_(True)
    try:
        for step in range(1, steps + 1):
            args, kwargs, target = records[(step - 1) % len(records)]
            loss = F.mse_loss(_first_tensor(block(*args, **kwargs)), target)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            with torch.no_grad():
                for p, g, (m, v) in zip(params, grads, moments):
                    if g is None:
                        continue
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
                    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)


def layer_by_layer_distillation(
    student: nn.Module,
    teacher: nn.Module,
    calibration: Iterable,
    *,
    blocks: str | None = None,
    steps: int = 100,
    lr: float = 1e-4,
) -> list[BlockError]:
    """Train each block of the quantized ``student`` to reproduce the matching block of
    the fp32 ``teacher`` on the calibration batches, one block at a time (see
    [Note: layer-by-layer distillation]). The student is changed in place; the teacher
    is only run.

    Args:
        student: the quantized model (from :func:`zeroquant` or ``init_compression``).
        teacher: the model before quantization, with the same block structure.
        calibration: batches the model takes (a tensor, a tuple of positional arguments
            or a mapping of keyword arguments); a handful is enough, each is kept in
            memory with every block's inputs.
        blocks: the name of the student's and teacher's ``ModuleList`` of blocks; None
            finds it (the longest list of modules holding linear layers).
        steps: Adam steps per block, cycling through the calibration batches.
        lr: Adam's learning rate. ZeroQuant's small rates keep the weights near the
            quantization grid they started on.

    Returns:
        A :class:`BlockError` per block: the MSE before and after its distillation. A
        block whose error rose gets its parameters back (with a warning), so ``after``
        never exceeds ``before``.

    Raises:
        ValueError: no calibration batch, ``steps`` < 1, or blocks that cannot be found or
            that differ in number between student and teacher.
    """
    calibration = list(calibration)
    if not calibration:
        raise ValueError("layer_by_layer_distillation: calibration is empty; pass a few batches of model inputs")
    if steps < 1:
        raise ValueError(f"layer_by_layer_distillation: steps must be >= 1, got {steps}")
    name, student_layers = find_blocks(student, blocks)
    _, teacher_layers = find_blocks(teacher, name)
    if len(student_layers) != len(teacher_layers):
        raise ValueError(
            f"layer_by_layer_distillation: the student has {len(student_layers)} blocks in {name!r} and the "
            f"teacher {len(teacher_layers)}; LKD pairs them one to one"
        )
    was_training = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    records = _record(teacher, teacher_layers, calibration)
    report = []
    for index, block in enumerate(student_layers):
        before = _block_error(block, records[index])
        start = {k: v.detach().clone() for k, v in block.state_dict().items()}
        _distill_block(block, records[index], steps=steps, lr=lr)
        after = _block_error(block, records[index])
        if after > before:  # too high a learning rate: keep the block as quantized
            block.load_state_dict(start)
            logger.warning(
                "zeroquant LKD: %s.%d's error rose (%.3g -> %.3g) and its parameters were put back; lower lkd_lr",
                name,
                index,
                before,
                after,
            )
            after = before
        report.append(BlockError(f"{name}.{index}", before, after))
        logger.debug("zeroquant LKD %s: mse %.3g -> %.3g", *vars(report[-1]).values())
    student.train(was_training[0])
    teacher.train(was_training[1])
    return report


def zeroquant(
    model: nn.Module,
    deepspeed_config,
    *,
    calibration: Iterable | None = None,
    blocks: str | None = None,
    lkd_steps: int = 100,
    lkd_lr: float = 1e-4,
) -> list[BlockError]:
    """ZeroQuant post-training quantization of a trained ``model``, in place: the
    ``compression_training`` section's ``weight_quantization`` (group-wise, ``target_bits``
    8 or 4 from the first forward) and ``activation_quantization`` (token-wise dynamic)
    are applied by :func:`init_compression`; with ``calibration`` batches each block is
    then distilled from a copy of the model taken before quantization
    (:func:`layer_by_layer_distillation`). ``init_inference(model, dtype=torch.int8)`` runs
    the result on int8 kernels.

    Args:
        model: the trained model; changed in place.
        deepspeed_config: the config dict or its JSON path; see the user guide's ZeroQuant
            section (``examples/configs/compression_zeroquant.json``).
        calibration: a few batches of model inputs for LKD; None quantizes only.
        blocks, lkd_steps, lkd_lr: :func:`layer_by_layer_distillation`'s ``blocks``,
            ``steps`` and ``lr``.

    Returns:
        The per-block errors of LKD (empty without calibration).

    Raises:
        ValueError: a section that schedules training (a QAT bit schedule, an offset,
            pruning or layer reduction), or one of :func:`init_compression`'s errors.
    """
    from shardwise.compression.compress import _read_config, init_compression

    check_post_training(_read_config(deepspeed_config))
    teacher = copy.deepcopy(model) if calibration is not None else None
    init_compression(model, deepspeed_config)
    if teacher is None:
        return []
    return layer_by_layer_distillation(model, teacher, calibration, blocks=blocks, steps=lkd_steps, lr=lkd_lr)
