"""Autotuning: find the fastest configuration that fits (ZeRO stage, micro-batch,
accumulation, offload, tensor and pipeline degrees) by pruning with the memory estimator
and measuring short runs.

Started by ``shardwise run --autotuning tune|run ... script.py ... --deepspeed ds_config.json``.
The space, the pruning and the search are plain data computed by pure functions
(``_space``, ``_prune``, ``_tuner``); running experiments is separate (``_experiment``,
with the launcher of ``_launchers``), and the engine's side of an experiment is ``runtime/_autotuning_profile.py``.
"""

from shardwise.autotuning._experiment import AutotuningError
from shardwise.autotuning._main import Resources, autotune, tune
from shardwise.autotuning._prune import MemoryBudget, prune
from shardwise.autotuning._space import Candidate, build_space, experiment_config
from shardwise.autotuning._tuner import Outcome, Status, search

__all__ = [
    "AutotuningError",
    "Candidate",
    "MemoryBudget",
    "Outcome",
    "Resources",
    "Status",
    "autotune",
    "build_space",
    "experiment_config",
    "prune",
    "search",
    "tune",
]
