"""Checkpoints without the frozen parameters: ``save_checkpoint(exclude_frozen_parameters=True)``.

[Note: checkpoints without frozen parameters]
A LoRA run (DeepSpeed-Chat, TRL, PEFT) trains adapters over a frozen base model and saves
with ``exclude_frozen_parameters=True`` so that each checkpoint does not carry the base
again. DeepSpeed then leaves the frozen parameters (``requires_grad=False``) out of the
module state dict and does not save their shapes and fragments (``frozen_param_shapes``,
``frozen_param_fragments``, which it otherwise writes at stages 2 and 3); buffers stay,
and the optimizer partitions are unchanged (frozen parameters have no optimizer state
and no fp32 master). Its ``load_checkpoint`` then needs ``load_module_strict=False``
(its strict load reports the frozen keys missing), and the frozen weights keep the
values the model was built with; ``zero_to_fp32`` gives the trainable parameters and
buffers only.

shardwise leaves out the same tensors at every ZeRO stage (at stage 3 the frozen units'
shards, see [Note: frozen units] in ``zero/_stage3.py``), under pipeline stages (each
stage its own frozen layers) and with experts, and records in the manifest which keys
were frozen (``skeletons.frozen``, every checkpoint) and that they were left out
(``exclude_frozen_parameters``). So a load knows the exclusion: a strict load checks
every other key and accepts exactly the recorded ones missing, provided the model holds
them frozen, which keep the model's values (DeepSpeed's non-strict load works the same).
A recorded key that is trainable in the loading model would start from the model's own
values, not the trained ones: a strict load refuses it, naming the parameters and the
fixes, and a non-strict one warns. ``zero_to_fp32`` and ``consolidate`` give the
trainable parameters and buffers and say the frozen ones are not in the checkpoint;
``get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True)`` drops the
recorded keys from any checkpoint.
"""

from __future__ import annotations

import logging

from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint import layout as ckpt_layout
from shardwise.runtime._placement import Placement

logger = logging.getLogger("shardwise")


def stored_frozen_keys(place: Placement) -> list[str]:
    """The manifest's record of this stage's frozen parameters: their state-dict keys as
    stored (experts by global id)."""
    return sorted(place.store(key) for key in place.frozen_keys)


def left_out(place: Placement, exclude: bool) -> frozenset[str]:
    """The parameter names a save leaves out: the frozen ones when ``exclude``."""
    return place.frozen if exclude else frozenset()


def excluded_keys(manifest: dict, place: Placement) -> frozenset[str]:
    """This stage's state-dict keys the checkpoint left out (empty unless it was saved
    with ``exclude_frozen_parameters=True``)."""
    if not ckpt_layout.excludes_frozen(manifest):
        return frozenset()
    recorded = set(ckpt_layout.frozen_keys(manifest) or ())
    return frozenset(key for key in place.keys if place.store(key) in recorded)


def check_excluded(excluded: frozenset[str], place: Placement, *, strict: bool, where: str) -> None:
    """Refuse (``strict``) or warn about the left-out keys whose parameter this model trains:
    they would keep the model's own values, not the trained ones."""
    trainable = sorted(key for key in excluded if place.name_of_key.get(key) not in place.frozen)
    if not trainable:
        return
    shown = ", ".join(trainable[:8]) + (f" and {len(trainable) - 8} more" if len(trainable) > 8 else "")
    if strict:
        raise CheckpointError(
            f"{where} was saved with exclude_frozen_parameters=True and so holds no tensor for {shown}, which "
            "this model trains (requires_grad=True). Freeze them as in the run that saved it "
            "(param.requires_grad_(False) before shardwise.initialize) so they keep the model's own values, or "
            "pass load_module_strict=False to train them on from the model's own values (the saved optimizer "
            "state has none for them); nothing was loaded"
        )
    logger.warning(
        "%s holds no tensor for %s (saved with exclude_frozen_parameters=True), which this model trains: they "
        "keep the model's own values",
        where,
        shown,
    )


def load_module(module, state: dict, *, strict: bool, excluded: frozenset[str]) -> None:
    """Load ``state`` into the module (a ``ModuleState``), strictly but for the
    ``excluded`` keys when ``strict``; a non-strict load warns about what it skipped."""
    result = module.load_state_dict(state, strict=strict and not excluded)
    missing = [key for key in result.missing_keys if key not in excluded]
    unexpected = list(result.unexpected_keys)
    if not (missing or unexpected):
        return
    if strict:
        raise RuntimeError(
            f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys {unexpected}; load with "
            "load_module_strict=False to skip them"
        )
    logger.warning("checkpoint loaded non-strictly: missing %s, unexpected %s", missing, unexpected)
