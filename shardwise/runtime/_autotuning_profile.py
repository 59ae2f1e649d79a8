"""The engine's side of an autotuning experiment: measure a window of optimizer steps,
write the metrics file the tuner reads, and end the process.

[Note: autotuning experiment]
The tuner (``shardwise/autotuning/``) starts each experiment with a config whose
``autotuning`` section is enabled and names ``metric_path``. The engine then holds an
:class:`AutotuningProfile` among its training features (see [Note: training features]):
``before_model_step(g)`` runs at every optimizer step before the step count moves, so the
wall time from the call with ``g = start_profile_step - 1`` to the call with
``g = end_profile_step`` covers ``end - start + 1`` whole training iterations (forward,
backward and optimizer step of each). Global rank 0 then writes one JSON object to
``metric_path``:

- ``throughput``: samples per second (``train_batch_size`` per iteration);
- ``latency``: milliseconds per iteration;
- ``num_steps``, ``elapsed_s``, ``train_batch_size``, ``world_size``: what was measured.

and every rank raises ``SystemExit(0)`` at that same step, so the job ends cleanly (exit
barrier included) as DeepSpeed's engine does after ``end_profile_step``. Units differ from
DeepSpeed's file (its throughput is samples per 10^-9 s of summed phase timers); the tuner
only compares experiments with each other. With ``model_info.profile`` and
``model_info_path`` set, rank 0 writes ``{"num_params", "trainable_num_params"}`` there
when the engine is built and every rank exits at once (the tuner's parameter count for the
memory estimator); with ``model_info_path`` and ``metric_path`` but no ``model_info.profile``
(the tuner's first experiment, [Note: autotuning pruning order]) rank 0 writes the count
and the experiment goes on to measure its window. An enabled section without ``metric_path`` (a run outside the tuner)
only logs that autotuning has no effect there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn

logger = logging.getLogger("shardwise")


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _write_json(path: str, payload: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    partial.replace(target)  # the tuner never reads half a file


def _model_shards(raw) -> int:
    """Ranks one copy of the model is split over by tensor and pipeline parallelism."""
    tp = (raw.get("tensor_parallel") or {}).get("autotp_size", 1)
    pp = (raw.get("pipeline") or {}).get("stages", 1)
    return max(tp if isinstance(tp, int) else 1, 1) * (pp if isinstance(pp, int) and pp > 0 else 1)


def write_model_info(config, model: nn.Module, *, then_exit: bool = True, shards: int = 1) -> None:
    """Write the parameter count to ``config.model_info_path`` (rank 0) and, with
    ``then_exit``, end the process (see [Note: autotuning experiment])."""
    seen, total, trainable = set(), 0, 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        numel = int(getattr(param, "ds_numel", param.numel()))  # full size under stage 3
        total += numel
        trainable += numel if param.requires_grad else 0
    rank, world = _rank_and_world()
    if rank == 0:
        scale = config.mp_size * shards  # each model-parallel rank holds about 1/scale of the model
        _write_json(config.model_info_path, {"num_params": total * scale, "trainable_num_params": trainable * scale})
    if then_exit:
        raise SystemExit(0)


class AutotuningProfile:
    """A training feature that measures ``start_profile_step..end_profile_step`` and exits
    (see [Note: autotuning experiment])."""

    name = "autotuning_profile"
    keyword_help: dict = {}

    def __init__(self, config, *, train_batch_size: int):
        self._config = config
        self._train_batch_size = train_batch_size
        self._first = max(config.start_profile_step - 1, 0)
        self._started: float | None = None

    def forward_kwargs(self, global_steps: int) -> dict:
        return {}

    def before_model_step(self, global_steps: int) -> None:
        if global_steps == self._first:
            self._started = time.perf_counter()
        if global_steps < self._config.end_profile_step or self._started is None:
            return
        elapsed = time.perf_counter() - self._started
        steps = global_steps - self._first
        rank, world = _rank_and_world()
        if rank == 0:
            _write_json(
                self._config.metric_path,
                {
                    "throughput": self._train_batch_size * steps / elapsed,
                    "latency": 1000.0 * elapsed / steps,
                    "num_steps": steps,
                    "elapsed_s": elapsed,
                    "train_batch_size": self._train_batch_size,
                    "world_size": world,
                },
            )
            logger.info("autotuning: wrote the metrics of %d steps to %s", steps, self._config.metric_path)
        raise SystemExit(0)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def autotuning_profile(config, model: nn.Module) -> AutotuningProfile | None:
    """The profiling feature ``config`` (a ``TrainConfig``) asks for, or None; a model-info
    run ends here (see [Note: autotuning experiment])."""
    tuning = config.autotuning
    if not tuning.enabled:
        return None
    if tuning.model_info is not None and tuning.model_info.profile and tuning.model_info_path:
        write_model_info(tuning, model, shards=_model_shards(config.raw))
    if tuning.model_info_path and tuning.metric_path:
        write_model_info(tuning, model, then_exit=False, shards=_model_shards(config.raw))
    if tuning.metric_path is None:
        logger.info(
            "autotuning.enabled has an effect only in an experiment started by "
            "'shardwise run --autotuning tune|run'; training normally"
        )
        return None
    return AutotuningProfile(tuning, train_batch_size=config.batch.train_batch_size)
