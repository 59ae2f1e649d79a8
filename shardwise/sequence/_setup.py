"""Sequence parallelism at ``initialize``: the grid's sequence groups from the config or an
``mpu``, and the combinations not built yet refused by name."""

from __future__ import annotations


def setup_sequence_parallel(model, grid, raw_config: dict, *, pipeline: bool) -> int:
    """Split ``grid``'s data axis into sequence groups when the config's
    ``sequence_parallel_size`` (or the grid, read from a DeepSpeed sequence-parallel mpu)
    asks for it; returns the size (1: sequences are not split)."""
    from shardwise.config._later import check_sequence_parallel_size

    size = raw_config.get("sequence_parallel_size", 1)
    check_sequence_parallel_size(size)
    if grid.sequence > 1 and size not in (1, grid.sequence):
        raise ValueError(
            f"sequence_parallel_size={size} in the config, but the mpu splits sequences over {grid.sequence} "
            "ranks; give one of them"
        )
    size = max(size, grid.sequence)
    if size == 1:
        return 1
    reasons = []
    if pipeline:
        reasons.append("a PipelineModule (pipeline stages)")
    if grid.tensor > 1:
        reasons.append(f"tensor parallelism (tensor size {grid.tensor})")
    from shardwise.moe._bind import moe_layers

    if moe_layers(model):
        reasons.append("MoE layers (their expert groups also split the data axis)")
    if reasons:
        raise ValueError(
            f"sequence_parallel_size={size} together with {' and '.join(reasons)} is not available in this "
            "version of shardwise (not built and tested together yet); use sequence parallelism with data "
            "parallelism and ZeRO"
        )
    grid.sequence_groups(size)
    return size
