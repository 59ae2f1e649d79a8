"""ZeRO-3 leaf modules: a module whose whole subtree is gathered as one unit.

Stage 3 gathers each module's own parameters around its forward. Some modules call
their children in data-dependent ways (a mixture of experts runs only the chosen
experts), so the children's gathers differ between ranks and between steps; marking
the parent a *leaf* makes its subtree's parameters one unit, gathered once before the
parent's forward. The flag is ``module._z3_leaf``, DeepSpeed's attribute name.
"""

from __future__ import annotations

from torch import nn


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked a ZeRO-3 leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) marked as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


_READS_CHILD_PARAMS = (nn.MultiheadAttention,)
"""torch modules whose forward reads a child's parameters without calling the child
(``MultiheadAttention`` passes ``out_proj.weight`` to a functional call): stage 3 treats
them as leaves always, or the child's parameters would never be gathered."""


def unit_roots(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose whole subtree stage 3 gathers as one unit: the
    marked leaves and the torch modules of ``_READS_CHILD_PARAMS``."""
    return [m for m in model.modules() if z3_leaf_module(m) or isinstance(m, _READS_CHILD_PARAMS)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) one module."""
    model._z3_leaf = flag


def _class_matches(module: nn.Module, classes) -> bool:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return any(cls is c if isinstance(c, type) else c in (cls.__name__, qualified) for c in classes)


def _mark(model: nn.Module, classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = list(classes)
    found = [m for m in model.modules() if _class_matches(m, classes)]
    for module in found:
        module._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of ``model`` whose class is in ``leaf_module_classes`` (classes, or
    class names, plain or fully qualified) as a leaf; returns them. Call before
    ``shardwise.initialize``: stage 3 lays out its units then."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Remove the leaf mark from the modules of those classes; returns them."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)
