"""Which layers of a model tensor parallelism splits, and how: the sharding policies.

[Note: sharding policies]
One policy per model family says which modules are column-parallel (attention query /
key / value, MLP up and gate: the output features are split, so each tensor rank
computes its own attention heads and its own slice of the MLP's hidden features) and
which are row-parallel (attention output, MLP down: the input features are split and
the partial products are summed over the tensor group). Everything else (embeddings,
norms, the LM head) stays whole on every tensor rank. Training AutoTP
(``autotp.apply_autotp``) and tensor-parallel inference share these policies.

Patterns are regular expressions matched against a module's whole dotted name
(``model.layers.0.self_attn.q_proj``). ``fused`` names column-parallel layers whose
output stacks several blocks (GPT-2's ``c_attn`` holds query, key and value one after
another): each block is split separately, so every rank gets its heads of each.
``head_attrs`` lists attributes of attention modules that count heads or head-sized
widths and must become per-rank (OPT's ``num_heads``); models whose attention infers
the number of heads from the projection's width need none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TPPolicy:
    """How tensor parallelism splits one model family (see [Note: sharding policies])."""

    name: str
    column: tuple[str, ...]
    """Module-name patterns of column-parallel layers (output features split)."""
    row: tuple[str, ...]
    """Module-name patterns of row-parallel layers (input features split)."""
    fused: dict[str, int] = field(default_factory=dict)
    """Column-parallel pattern -> number of blocks stacked in its output."""
    head_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Module class name -> attributes divided by the tensor-parallel size."""
    head_counts: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads")
    """Model-config attributes that must divide by the tensor-parallel size."""
    shared_inputs: tuple[str, ...] = ()
    """Module-name patterns of modules whose input (``hidden_states``, or the first
    argument) is read only by their column-parallel children: the input enters the tensor
    region once for all of them (see [Note: one input region for sibling layers])."""

    def kind(self, module_name: str) -> str | None:
        """ "column", "row" or None for the module named ``module_name``."""
        if any(re.fullmatch(p, module_name) for p in self.column):
            return "column"
        if any(re.fullmatch(p, module_name) for p in self.row):
            return "row"
        return None

    def blocks(self, module_name: str) -> int:
        """How many stacked blocks the output of column-parallel ``module_name`` holds."""
        return next((n for p, n in self.fused.items() if re.fullmatch(p, module_name)), 1)


_LLAMA_LIKE = dict(
    column=(r".*\.self_attn\.[qkv]_proj", r".*\.mlp\.(gate|up)_proj"),
    row=(r".*\.self_attn\.o_proj", r".*\.mlp\.down_proj"),
    shared_inputs=(r".*\.self_attn", r".*\.mlp"),
)

POLICIES: dict[str, TPPolicy] = {
    "llama": TPPolicy("llama", **_LLAMA_LIKE),
    "mistral": TPPolicy("mistral", **_LLAMA_LIKE),
    "qwen2": TPPolicy("qwen2", **_LLAMA_LIKE),
    "gpt2": TPPolicy(
        "gpt2",
        column=(r".*\.attn\.c_attn", r".*\.mlp\.c_fc"),
        row=(r".*\.attn\.c_proj", r".*\.mlp\.c_proj"),
        fused={r".*\.attn\.c_attn": 3},
        head_attrs={"GPT2Attention": ("num_heads", "split_size")},
        head_counts=("n_head",),
    ),
    "opt": TPPolicy(
        "opt",
        column=(r".*\.self_attn\.[qkv]_proj", r".*\.fc1"),
        row=(r".*\.self_attn\.out_proj", r".*\.fc2"),
        head_attrs={"OPTAttention": ("num_heads",)},
        shared_inputs=(r".*\.self_attn",),
    ),
    "gpt_neox": TPPolicy(
        "gpt_neox",
        column=(r".*\.attention\.query_key_value", r".*\.mlp\.dense_h_to_4h"),
        row=(r".*\.attention\.dense", r".*\.mlp\.dense_4h_to_h"),
    ),
}
"""Built-in policies by Hugging Face ``config.model_type``."""


def policy_from_layer_specs(
    specs: list[dict], *, name: str = "partition_config", model_type: str | None = None
) -> TPPolicy:
    """A policy from DeepSpeed's ``tensor_parallel.partition_config.layer_specs``: each spec
    has ``patterns`` (regular expressions on parameter names such as
    ``.*\\.o_proj\\.weight$``, or on module names) and ``partition_type`` ``"row"`` or
    ``"column"``; ``"shape": [k, -1]`` on a column spec marks ``k`` stacked blocks; a
    spec with ``model_types`` applies only to models of those ``config.model_type``."""
    column, row, fused = [], [], {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or "patterns" not in spec or "partition_type" not in spec:
            raise ValueError(
                f"{name}.layer_specs[{i}] must be an object with 'patterns' and 'partition_type', got {spec!r}"
            )
        kind = spec["partition_type"]
        if kind not in ("row", "column"):
            raise ValueError(f"{name}.layer_specs[{i}].partition_type must be 'row' or 'column', got {kind!r}")
        extra = set(spec) - {"patterns", "partition_type", "shape", "partition_dim", "model_types"}
        if extra:
            raise ValueError(
                f"{name}.layer_specs[{i}] has unknown keys {sorted(extra)}; allowed: patterns, "
                "partition_type, shape, partition_dim, model_types"
            )
        if spec.get("model_types") and model_type not in spec["model_types"]:
            continue
        if spec.get("partition_dim") not in (None, 0):
            raise ValueError(
                f"{name}.layer_specs[{i}].partition_dim={spec['partition_dim']!r}: only 0 (the "
                "stacked output blocks of a fused column-parallel layer) is supported"
            )
        patterns = [
            _module_pattern(p) for p in ([spec["patterns"]] if isinstance(spec["patterns"], str) else spec["patterns"])
        ]
        (column if kind == "column" else row).extend(patterns)
        shape = spec.get("shape")
        if shape is not None:
            if kind != "column" or not (
                isinstance(shape, list)
                and len(shape) == 2
                and shape[1] == -1
                and isinstance(shape[0], int)
                and shape[0] >= 1
            ):
                raise ValueError(
                    f"{name}.layer_specs[{i}].shape={shape!r}: only [k, -1] on a column spec (k "
                    "stacked output blocks, each split separately) is supported"
                )
            fused.update(dict.fromkeys(patterns, shape[0]))
    return TPPolicy(name, column=tuple(column), row=tuple(row), fused=fused, head_counts=())


def _module_pattern(pattern: str) -> str:
    """A parameter-name pattern (``...\\.weight$``) as a pattern on the module's name."""
    pattern = pattern.removeprefix("^").removesuffix("$")
    for suffix in (r"\.weight", r"\.bias", r"\.(weight|bias)"):
        if pattern.endswith(suffix):
            return pattern[: -len(suffix)]
    return pattern


def policy_from_hf_tp_plan(plan: dict[str, str], *, prefix: str) -> TPPolicy:
    """A policy from a Hugging Face ``base_model_tp_plan`` ("colwise" / "rowwise" by
    module path with ``*`` for the layer index); other styles are refused by name."""
    column, row = [], []
    for path, style in plan.items():
        pattern = (re.escape(prefix) + r"\." if prefix else "") + re.escape(path).replace(r"\*", r"\d+")
        if style == "colwise":
            column.append(pattern)
        elif style == "rowwise":
            row.append(pattern)
        else:
            raise ValueError(
                f"the model's Hugging Face tp_plan splits {path!r} as {style!r}, which shardwise's "
                "AutoTP does not build; give tensor_parallel.partition_config.layer_specs instead"
            )
    return TPPolicy("tp_plan", column=tuple(column), row=tuple(row))
