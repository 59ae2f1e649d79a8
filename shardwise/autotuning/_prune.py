"""Pruning before anything runs: the memory estimator's model-state bytes per rank for each
candidate, against the memory one rank may use. Pure functions.

Only model states (parameters, gradients, optimizer state; ``tools/estimate.py``) are
estimated: activations grow with the micro-batch and are left to the experiments (one
that runs out of memory fails, is recorded and skipped). Training on CPU, offloaded state
lands in the same memory, so it still counts.

[Note: dominated candidates]
A candidate is also pruned when another one of the same batch shape (micro-batch,
accumulation, tensor and pipeline degrees) does strictly less work (a lower ZeRO stage, or
less offload) and the estimator puts it at no more memory per rank: sharding over one
data-parallel rank saves nothing, nor does offloading to the CPU a CPU run already uses,
so such a candidate can only be as fast or slower. On several data-parallel ranks, or on
GPUs with offload, the memory differs and both are kept.
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
    shards = candidate.tp * candidate.pp  # each tensor/pipeline rank holds 1/shards of the model
    ranks = max(budget.ranks_per_node // shards, 1)  # data-parallel ranks per machine
    row = estimate(
        -(-budget.num_params // shards),
        num_nodes=budget.num_nodes,
        devices_per_node=ranks,
        dtype=budget.dtype,
        stage=candidate.stage,
        offload_optimizer=candidate.offload_optimizer,
        offload_param=candidate.offload_param,
    )
    if budget.on_cpu:
        return row.device_bytes + row.cpu_bytes_per_node / ranks
    return row.device_bytes


def _less_work(a: Candidate, b: Candidate) -> bool:
    """``a`` shards and offloads no more than ``b``, and is not ``b``."""
    return (
        a != b
        and (a.micro_batch, a.gas, a.tp, a.pp) == (b.micro_batch, b.gas, b.tp, b.pp)
        and a.stage <= b.stage
        and a.offload_optimizer <= b.offload_optimizer
        and a.offload_param <= b.offload_param
    )


def prune(candidates: list[Candidate], budget: MemoryBudget) -> tuple[list[Candidate], dict[Candidate, str]]:
    """Split ``candidates`` into those that fit ``budget`` and are not dominated, and the
    others (with why; see [Note: dominated candidates])."""
    fitting, rejected = [], {}
    need = {candidate: required_bytes(candidate, budget) for candidate in candidates}
    for candidate in candidates:
        if need[candidate] > budget.bytes_per_rank:
            rejected[candidate] = (
                f"the memory estimator puts its model states at {_gib(need[candidate])} per rank; "
                f"{_gib(budget.bytes_per_rank)} is available"
            )
        else:
            fitting.append(candidate)
    kept = []
    for candidate in fitting:
        better = [c for c in fitting if _less_work(c, candidate) and need[c] <= need[candidate]]
        if better:
            rejected[candidate] = (
                f"dominated by {min(better).name}: the memory estimator puts both at {_gib(need[candidate])} "
                "per rank or less, and that one shards or offloads less"
            )
        else:
            kept.append(candidate)
    return kept, rejected


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"
