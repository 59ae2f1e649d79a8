"""The pipeline engine: DeepSpeed's ``PipelineEngine`` names over a stage runner.

``train_batch`` and ``eval_batch`` build this stage's action list from the schedule (a
pure function, see ``schedules.py``) and hand it to the :class:`StageRunner` the engine
holds (``_runner.py``, [Note: one batch on one stage]); the engine keeps the config, the
data iterator, the step's counters and the batch loss DeepSpeed's callers read.
"""

from __future__ import annotations

import logging

import torch

from shardwise.config._pipeline import schedule_of
from shardwise.pipe import schedules as sched
from shardwise.pipe._runner import StageParts, StageRunner
from shardwise.pipe.module import PipelineError, PipelineModule
from shardwise.runtime.engine import Engine

logger = logging.getLogger("shardwise")


class PipelineEngine(Engine):
    """The engine ``initialize(model=PipelineModule(...))`` returns (DeepSpeed's
    ``PipelineEngine``): train with :meth:`train_batch`, evaluate with :meth:`eval_batch`."""

    def __init__(self, *, model: PipelineModule, config, grid, **kwargs):
        super().__init__(model=model, config=config, grid=grid, **kwargs)
        self.num_stages, self.stage_id = grid.pipe, grid.stage_id
        self.micro_batches = self.gradient_accumulation_steps()
        section = config.raw.get("pipeline") or {}
        self.schedule_name = schedule_of(section, zero_stage=config.zero.stage)
        self.virtual_stages = model.virtual_stages
        configured = section.get("virtual_stages", 2 if self.schedule_name == "interleaved" else 1)
        if configured != model.virtual_stages:
            raise PipelineError(
                f"the config's pipeline schedule {self.schedule_name!r} runs {configured} model chunk(s) "
                f"per stage but the PipelineModule has virtual_stages={model.virtual_stages}; the "
                "interleaved schedule and PipelineModule(virtual_stages=...) go together"
            )
        self.schedule_options = {"virtual_stages": model.virtual_stages} if model.virtual_stages > 1 else {}
        if section.get("activation_checkpoint_interval"):  # the config's wins, as in DeepSpeed
            model.set_checkpoint_interval(section["activation_checkpoint_interval"])
        keep_gathered = bool(section.get("keep_gathered", True))
        # ZeRO 2 (and 3 with its layers kept gathered): gradients accumulate whole over the
        # batch and are reduced once, at its last backward, instead of after every micro-batch
        stage = config.zero.stage
        reduce_once = stage == 2 or (stage == 3 and keep_gathered)
        if reduce_once:
            self.strategy.accumulate_unreduced = True
        if self.schedule_name in ("zero_bubble", "1f1b_split") and stage == 3 and not keep_gathered:
            raise PipelineError(
                f"the {self.schedule_name} schedule splits backwards into input and weight halves, "
                "so at ZeRO stage 3 it keeps a stage's layers gathered across the batch: remove "
                "pipeline.keep_gathered: false, or use the 1f1b schedule"
            )
        parts = StageParts(
            module=model,
            grid=grid,
            strategy=self.strategy,
            policy=self.policy,
            loss_scaler=self.loss_scaler,
            timer=self._progress.timer,
            step=self._model_step,
        )
        self._runner = StageRunner(
            parts, keep_gathered=keep_gathered, reduce_once=reduce_once, timeout_s=config.comm.timeout_s
        )
        self._device = self._runner.device
        self.data_iterator = None
        if self.training_dataloader is not None:  # initialize(training_data=...): read it forever, as DeepSpeed
            from shardwise.runtime.data import RepeatingLoader

            self.set_dataiterator(RepeatingLoader(self.training_dataloader))
        self.agg_train_loss: torch.Tensor | None = None

    # -- stages -----------------------------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        """The iterator ``train_batch`` / ``eval_batch`` read when not given one."""
        self.data_iterator = iterator

    # -- what the ordinary engine does and a pipeline does not ------------------------------

    def forward(self, *args, **kwargs):
        raise PipelineError(
            "a pipeline engine runs whole batches: call engine.train_batch(data_iter) or "
            "engine.eval_batch(data_iter) instead of engine(...)"
        )

    def backward(self, *args, **kwargs):
        raise PipelineError(
            "a pipeline engine runs whole batches: call engine.train_batch(data_iter); it does "
            "the backward and the step"
        )

    def step(self, *args, **kwargs):
        raise PipelineError(
            "a pipeline engine runs whole batches: call engine.train_batch(data_iter); it does "
            "the backward and the step"
        )

    # -- training ---------------------------------------------------------------------------

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one batch of ``gradient_accumulation_steps`` micro-batches through the
        pipeline, reduce and step; returns the batch's mean loss on every rank."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        actions = sched.build_schedule(
            self.schedule_name, self.num_stages, self.micro_batches, self.stage_id, **self.schedule_options
        )
        # every training schedule ends with its OptimizerStep, which calls _model_step
        run = self._runner.run(actions, self.data_iterator, training=True, micro_batches=self.micro_batches)
        self.agg_train_loss = self._batch_loss(run.losses)
        self._progress.record_loss(self.agg_train_loss)
        self._progress.after_model_step()
        return self.agg_train_loss

    def _model_step(self) -> None:
        """The batch's optimizer step and counters (the runner's ``OptimizerStep``); the
        training features see it first, as in ``Engine.step`` (the autotuning profile
        included: ``train_batch`` is what an experiment times)."""
        with self._progress.timer("step"):
            self.training_features.before_model_step(self.global_steps)
            self._take_model_step(None)
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.micro_batches * self.comm.world_size

    def _batch_loss(self, losses: list[torch.Tensor], *, broadcast: bool = True) -> torch.Tensor:
        """The batch's mean loss: averaged over micro-batches and data-parallel ranks on the
        last stage, then (``broadcast``) sent to every stage (DeepSpeed's ``agg_train_loss``)."""
        loss = (
            torch.stack([x.float() for x in losses]).mean().reshape(1)
            if losses
            else torch.zeros(1, device=self._device)
        )
        loss = loss.to(self._device)
        if self.is_last_stage() and self.comm.world_size > 1:
            self.comm.all_reduce(loss, tag="batch loss").wait()
            loss /= self.comm.world_size
        if broadcast and self.num_stages > 1:
            self.grid.pipe_comm.broadcast(loss, src=self.num_stages - 1, tag="batch loss").wait()
        return loss[0]

    # -- evaluation -------------------------------------------------------------------------

    def eval_batch(
        self,
        data_iter,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """Forward ``num_micro_batches`` (default ``gradient_accumulation_steps``) micro-batches
        from ``data_iter`` without gradients, as DeepSpeed's ``eval_batch``: returns the mean
        loss (``reduce_output="avg"``, averaged over data-parallel ranks too; on every stage
        with ``bcast_loss``, else on the last stage and None elsewhere) or the list of losses
        (None), and with ``return_logits`` also the last stage's outputs (``(loss, logits)``).
        The training iterator is restored afterwards."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        self.module.eval()
        try:
            with torch.no_grad():
                actions = sched.build_schedule(
                    "eval", self.num_stages, micro_batches, self.stage_id, **self.schedule_options
                )
                run = self._runner.run(
                    actions, data_iter, training=False, micro_batches=micro_batches, compute_loss=compute_loss
                )
        finally:
            self.module.train()
            self.set_dataiterator(train_iterator)
        if reduce_output is None:
            result = run.losses if compute_loss else run.logits
        elif compute_loss and (bcast_loss or self.is_last_stage()):
            result = self._batch_loss(run.losses, broadcast=bcast_loss)
        else:
            result = None
        if return_logits:
            return result, (run.logits if self.is_last_stage() else None)
        return result
