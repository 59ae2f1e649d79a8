"""Pruning before anything runs: the memory estimator's model-state bytes per rank for each
candidate, against the memory one rank may use. Pure functions.

Only model states (parameters, gradients, optimizer state; ``tools/estimate.py``) are
estimated: activations grow with the micro-batch and are left to the experiments (one
that runs out of memory fails, is recorded and skipped). Training on CPU, offloaded state
lands in the same memory, so it still counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.autotuning._space import Candidate
from shardwise.tools.estimate import estimate


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """What pruning compares against."""

    num_params: int
    """Parameters of the model."""
    dtype: str
    """``fp32``, ``fp16`` or ``bf16`` (the training precision)."""
    num_nodes: int
    """Machines of one experiment."""
    ranks_per_node: int
    """Data-parallel ranks per machine."""
    bytes_per_rank: float
    """Memory one rank may hold."""
    on_cpu: bool
    """Training on CPU: offloaded state counts against the same memory."""


def required_bytes(candidate: Candidate, budget: MemoryBudget) -> float:
    """Model-state bytes one rank of ``candidate`` needs in the memory ``budget`` counts."""
    row = estimate(
        budget.num_params,
        num_nodes=budget.num_nodes,
        devices_per_node=budget.ranks_per_node,
        dtype=budget.dtype,
        stage=candidate.stage,
        offload_optimizer=candidate.offload_optimizer,
        offload_param=candidate.offload_param,
    )
    if budget.on_cpu:
        return row.device_bytes + row.cpu_bytes_per_node / budget.ranks_per_node
    return row.device_bytes


def prune(candidates: list[Candidate], budget: MemoryBudget) -> tuple[list[Candidate], dict[Candidate, str]]:
    """Split ``candidates`` into those that fit ``budget`` and those that do not (with why)."""
    kept, rejected = [], {}
    for candidate in candidates:
        need = required_bytes(candidate, budget)
        if need > budget.bytes_per_rank:
            rejected[candidate] = (
                f"the memory estimator puts its model states at {_gib(need)} per rank; "
                f"{_gib(budget.bytes_per_rank)} is available"
            )
        else:
            kept.append(candidate)
    return kept, rejected


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"
