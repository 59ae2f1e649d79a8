"""The sparsity config object a ``sparse_attention`` config section describes."""

from __future__ import annotations

from typing import Any

from shardwise.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

_CLASSES = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}


def sparsity_config_from_dict(section: dict[str, Any] | None, num_heads: int) -> SparsityConfig | None:
    """Build the sparsity config of a ``sparse_attention`` section for a layer of ``num_heads``.

    Args:
        section: the section as written in a DeepSpeed-style config (validated here: unknown
            keys and modes are refused by name; DeepSpeed's defaults fill the rest), or the
            resolved dict of ``DeepSpeedConfig.sparse_attention``. None gives None.
        num_heads: the attention heads of the layer the layout is for.
    """
    from shardwise.config._sparse_attention import sparse_attention_section

    resolved = sparse_attention_section(section)
    if resolved is None:
        return None
    kwargs = {key: value for key, value in resolved.items() if key != "mode"}
    return _CLASSES[resolved["mode"]](num_heads=num_heads, **kwargs)
