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
- with ``metric: "flops"``, ``flops``: FLOP/s per rank (see [Note: autotuning FLOPs]), and
  ``flops_per_step``, the FLOPs of one iteration per rank;
- ``num_steps``, ``elapsed_s``, ``train_batch_size``, ``world_size``:
  what was measured.

and every rank raises ``SystemExit(0)`` at that same step, so the job ends cleanly (exit
barrier included) as DeepSpeed's engine does after ``end_profile_step``. Units differ from
DeepSpeed's file (its throughput is samples per 10^-9 s of summed phase timers); the tuner
only compares experiments with each other. An enabled section without ``metric_path`` (a
run not started by the tuner) does what DeepSpeed's engine does: it measures the same
window, writes ``autotuning_metric.json`` in the working directory and exits (logged when
the engine is built). With ``model_info.profile`` rank 0 writes ``{"num_params",
"trainable_num_params"}`` to ``model_info_path`` (default ``autotuning_model_info.json`` in
the working directory, as DeepSpeed) when the engine is built and every rank exits at once
(the tuner's parameter count for the memory estimator); with ``model_info_path`` and
``metric_path`` but no ``model_info.profile`` (the tuner's first experiment, [Note:
autotuning pruning order]) rank 0 writes the count and the experiment goes on to measure
its window.

[Note: autotuning FLOPs]
DeepSpeed's engine runs its FLOPs profiler over the forward of one micro-batch at
``start_profile_step`` on rank 0 and reports ``FLOPS_per_gpu`` = 3 x those forward FLOPs x
the accumulation steps / the iteration's latency (its tuner then looks up ``flops`` in the
file, which its engine never writes). Here, with ``metric: "flops"``, every rank counts, with
``torch.utils.flop_counter`` (the counter of the ``flops_profiler``, see [Note: how FLOPs
are counted]), the FLOPs of one whole iteration: every micro-batch's forward and backward
(the backward counted, not assumed to be twice the forward, so recomputed activations
count) and the optimizer step, from ``before_model_step(c - 1)`` to
``before_model_step(c)``: the iteration just before the timed window
(``c = start_profile_step - 1``), or with ``start_profile_step = 1``, which leaves none,
the one just after it (``c = end_profile_step + 1``: the experiment writes its metrics and
exits one step later). The counter's cost (a Python call per operator: an iteration of a
small model on a GPU took 4x as long) is never timed. The ranks' counts are summed with one
all-reduce at ``before_model_step(c)``, outside the window too, and divided by the world
size: ``flops = flops_per_step x num_steps / elapsed_s``, the mean
FLOP/s a rank achieved, whatever tensor or pipeline stage it holds. The counter's first use
in a process costs one to a few seconds of imports (``torch._dynamo``, for its
FlexAttention formulas): it is paid when the engine is built, outside the window, and only
with ``metric: "flops"``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("shardwise")

METRIC_FILE = "autotuning_metric.json"
"""DeepSpeed's metric file in the working directory when ``metric_path`` is not set."""
MODEL_INFO_FILE = "autotuning_model_info.json"
"""DeepSpeed's model-info file in the working directory when ``model_info_path`` is not set."""


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


def write_model_info(config, model: nn.Module, *, path: str, then_exit: bool = True, shards: int = 1) -> None:
    """Write the parameter count to ``path`` (rank 0) and, with ``then_exit``, end the
    process (see [Note: autotuning experiment])."""
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
        _write_json(path, {"num_params": total * scale, "trainable_num_params": trainable * scale})
    if then_exit:
        raise SystemExit(0)


class _StepFlops:
    """Counts the FLOPs of one iteration on every rank and averages them over the ranks
    (see [Note: autotuning FLOPs])."""

    def __init__(self, start_profile_step: int, end_profile_step: int):
        from shardwise.profiling.flops_profiler._profiler import _warm_up_counter

        _warm_up_counter()  # its imports are paid here, not in a counted or timed step
        self.last = start_profile_step - 1 if start_profile_step > 1 else end_profile_step + 1
        """The ``before_model_step`` call that ends the counted iteration (the one before the
        window, or after it when the window starts at the first step)."""
        self.per_rank: float | None = None
        """The ranks' mean FLOPs of that iteration, once counted."""
        self._counter = None

    def before_model_step(self, global_steps: int) -> None:
        if global_steps == self.last - 1:
            from torch.utils.flop_counter import FlopCounterMode

            from shardwise.profiling.flops_profiler._formulas import extra_formulas

            self._counter = FlopCounterMode(display=False, custom_mapping=extra_formulas())
            self._counter.__enter__()
        elif global_steps == self.last and self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            self.per_rank = _mean_over_ranks(counter.get_total_flops())


def _mean_over_ranks(value: int) -> float:
    """``value`` averaged over every rank (one all-reduce of one number)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(value)
    from shardwise import comm
    from shardwise.accelerator import get_accelerator

    device = get_accelerator().current_device_name() if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor([float(value)], dtype=torch.float64, device=device)
    comm.all_reduce(total, log_name="autotuning flops")
    return total.item() / dist.get_world_size()


class AutotuningProfile:
    """A training feature that measures ``start_profile_step..end_profile_step`` and exits
    (see [Note: autotuning experiment])."""

    name = "autotuning_profile"
    keyword_help: dict = {}

    def __init__(self, config, *, train_batch_size: int, metric_path: str | None = None):
        self._config = config
        self._metric_path = metric_path or config.metric_path
        self._train_batch_size = train_batch_size
        self._first = max(config.start_profile_step - 1, 0)
        self._started: float | None = None
        self._window: tuple[int, float] | None = None  # (steps, seconds), once measured
        self._flops = (
            _StepFlops(config.start_profile_step, config.end_profile_step) if config.metric == "flops" else None
        )

    def forward_kwargs(self, global_steps: int) -> dict:
        return {}

    def before_model_step(self, global_steps: int) -> None:
        # the window's edges sit outside the counted iteration's (see [Note: autotuning FLOPs])
        if global_steps == self._config.end_profile_step and self._started is not None:
            self._window = (global_steps - self._first, time.perf_counter() - self._started)
        if self._flops is not None:
            self._flops.before_model_step(global_steps)
        if global_steps == self._first:
            self._started = time.perf_counter()
        if self._window is not None and (self._flops is None or self._flops.per_rank is not None):
            self._write_and_exit(*self._window)

    def after_optimizer_step(self, global_steps: int, clip_coef: float | None) -> None:
        del global_steps, clip_coef  # nothing moves after the optimizer step

    def _write_and_exit(self, steps: int, elapsed: float) -> None:
        rank, world = _rank_and_world()
        if rank == 0:
            metrics = {
                "throughput": self._train_batch_size * steps / elapsed,
                "latency": 1000.0 * elapsed / steps,
                "num_steps": steps,
                "elapsed_s": elapsed,
                "train_batch_size": self._train_batch_size,
                "world_size": world,
            }
            if self._flops is not None:
                flops_per_step = self._flops.per_rank or 0.0
                metrics.update(flops=flops_per_step * steps / elapsed, flops_per_step=flops_per_step)
            _write_json(self._metric_path, metrics)
            logger.info("autotuning: wrote the metrics of %d steps to %s", steps, self._metric_path)
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
    shards = _model_shards(config.raw)
    if tuning.model_info is not None and tuning.model_info.profile:
        path = tuning.model_info_path or os.path.join(os.getcwd(), MODEL_INFO_FILE)
        write_model_info(tuning, model, path=path, shards=shards)
    if tuning.model_info_path and tuning.metric_path:
        write_model_info(tuning, model, path=tuning.model_info_path, then_exit=False, shards=shards)
    metric_path = tuning.metric_path
    if metric_path is None:
        metric_path = os.path.join(os.getcwd(), METRIC_FILE)
        logger.warning(
            "autotuning.enabled without autotuning.metric_path (a run not started by 'shardwise run "
            "--autotuning'): as DeepSpeed's engine, this run measures optimizer steps %d..%d, writes the "
            "metrics to %s and exits; set autotuning.enabled to false to train normally",
            tuning.start_profile_step,
            tuning.end_profile_step,
            metric_path,
        )
    return AutotuningProfile(tuning, train_batch_size=config.batch.train_batch_size, metric_path=metric_path)
