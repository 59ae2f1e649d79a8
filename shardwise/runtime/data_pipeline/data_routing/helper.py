"""Converting a model's layers to random-LTD and saving it without the wrappers.

``convert_to_random_ltd(model, Block)`` wraps every ``Block`` in a ``RandomLayerTokenDrop``;
its state dict then holds ``...random_ltd_layer...`` keys, which
``remove_random_ltd_state_dict`` strips so the weights load into the unconverted model.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from shardwise.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop

_WRAPPED = "random_ltd_layer"


def _inner(model) -> nn.Module:
    """The nn.Module of ``model``: an engine's ``.module``, else ``model`` itself."""
    module = getattr(model, "module", None)
    return module if isinstance(module, nn.Module) else model


def convert_to_random_ltd(model, convert_type: type | tuple[type, ...]):
    """Wrap every submodule of type ``convert_type`` in ``RandomLayerTokenDrop``, in place,
    and return ``model`` (a module or an engine; an engine's ``.module`` is converted).

    Layers already wrapped are left alone, so converting twice is harmless. DeepSpeed then
    calls the engine's ``random_ltd_initialize``; an engine that has one is called the same
    way. Without an engine, ``RandomLTD.from_config(section, model, ...)`` turns the
    section's layers on.
    """
    root = _inner(model)
    if isinstance(root, convert_type) and not isinstance(root, RandomLayerTokenDrop):
        raise TypeError(f"convert_to_random_ltd cannot wrap the model itself ({type(root).__name__}); pass its parent")
    targets = []
    for name, module in root.named_modules():
        parent_name, _, child = name.rpartition(".")
        if not name or not isinstance(module, convert_type) or child == _WRAPPED:
            continue
        targets.append((root.get_submodule(parent_name) if parent_name else root, child, module))
    for parent, child, module in targets:
        setattr(parent, child, RandomLayerTokenDrop(module))
    if callable(getattr(type(model), "random_ltd_initialize", None)):
        model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: dict) -> OrderedDict:
    """A copy of ``state_dict`` whose keys lose their ``random_ltd_layer`` path component
    (``h.1.random_ltd_layer.attn.weight`` -> ``h.1.attn.weight``); values are shared."""
    cleaned = OrderedDict()
    for key, value in state_dict.items():
        cleaned[".".join(part for part in key.split(".") if part != _WRAPPED)] = value
    return cleaned


def save_without_random_ltd(model) -> OrderedDict:
    """The state dict of ``model`` (or an engine's ``.module``) as the unconverted model's."""
    return remove_random_ltd_state_dict(_inner(model).state_dict())
