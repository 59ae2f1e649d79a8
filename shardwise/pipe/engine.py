"""The pipeline engine: runs a schedule's actions for one batch on this stage.

[Note: one batch on one stage]
``train_batch`` builds this stage's action list from the schedule (a pure function, see
``schedules.py``) and executes it: the first and the last stage read each micro-batch
``(inputs, labels)`` from the data iterator (inputs feed the first stage, labels the loss
on the last); activations and gradients travel as pytrees over the pipe axis (see [Note:
pytree transfers with a shape handshake] in ``_transfer.py``; between stages on one host
with CPU tensors, [Note: pipeline transfers through shared memory] in
``_shared_transfer.py``). A split schedule's ``BackwardInput`` and ``BackwardWeight`` run
the two halves of [Note: split backward]. Each backward goes
through the ZeRO strategy like the ordinary engine's, with the last micro-batch's
backward as the accumulation boundary, so gradients are reduced over the data-parallel
group once per batch, overlapped with that backward. The loss of every micro-batch is
divided by their number, so the step sees the batch's mean gradient.

Tied weights (``TiedLayerSpec``) are used on several stages. Their gradients must be
summed across those stages before the optimizer sees them, but a stage cannot wait for
another inside its backward without stalling the schedule. So each stage routes a tied
weight through :class:`_CaptureGrad`, which keeps that weight's gradient aside instead
of giving it to the parameter; after the last micro-batch the kept gradients are summed
over the stages holding the weight and fed to the parameter in one extra backward, which
is then the accumulation boundary. Every copy gets the same gradient, so they stay equal;
the global norm counts each copy ``1 / copies`` (see [Note: the global norm over the
grid] in ``zero/_strategy.py``).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from shardwise.accelerator import get_accelerator
from shardwise.pipe import schedules as sched
from shardwise.pipe._split_backward import backward_input
from shardwise.pipe._shared_transfer import SharedChannel, open_links
from shardwise.pipe._transfer import Channel
from shardwise.pipe.module import PipelineError, PipelineModule
from shardwise.runtime.engine import Engine
from shardwise.zero import GatheredParameters

logger = logging.getLogger("shardwise")


class _CaptureGrad(torch.autograd.Function):
    """Identity forward; backward adds the gradient to ``store`` and passes zeros on (so
    the parameter's gradient hooks, which the ZeRO strategies count on, still fire)."""

    @staticmethod
    def forward(ctx, weight, store):
        ctx.store = store
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        store = ctx.store
        store["grad"] = grad.detach().clone() if store.get("grad") is None else store["grad"] + grad
        return torch.zeros_like(grad), None


class PipelineEngine(Engine):
    """The engine ``initialize(model=PipelineModule(...))`` returns (DeepSpeed's
    ``PipelineEngine``): train with :meth:`train_batch`, evaluate with :meth:`eval_batch`."""

    def __init__(self, *, model: PipelineModule, config, grid, **kwargs):
        super().__init__(model=model, config=config, grid=grid, **kwargs)
        self.num_stages, self.stage_id = grid.pipe, grid.stage_id
        self.micro_batches = self.gradient_accumulation_steps()
        section = config.raw.get("pipeline") or {}
        self.schedule_name = section.get("schedule", "1f1b")
        self.virtual_stages = model.virtual_stages
        configured = section.get("virtual_stages", 2 if self.schedule_name == "interleaved" else 1)
        if configured != model.virtual_stages:
            raise PipelineError(f"the config's pipeline schedule {self.schedule_name!r} runs {configured} model chunk(s) "
                                f"per stage but the PipelineModule has virtual_stages={model.virtual_stages}; the "
                                "interleaved schedule and PipelineModule(virtual_stages=...) go together")
        self.schedule_options = {"virtual_stages": model.virtual_stages} if model.virtual_stages > 1 else {}
        if section.get("activation_checkpoint_interval"):  # the config's wins, as in DeepSpeed
            model.set_checkpoint_interval(section["activation_checkpoint_interval"])
        self._device = get_accelerator().device()
        self._keep_gathered = bool(section.get("keep_gathered", True))
        self._holding = None
        # ZeRO 2 (and 3 with its layers kept gathered): gradients accumulate whole over the
        # batch and are reduced once, at its last backward, instead of after every micro-batch
        stage = config.zero.stage
        self._reduce_once = stage == 2 or (stage == 3 and self._keep_gathered)
        if self._reduce_once:
            self.strategy.accumulate_unreduced = True
        if self.schedule_name in ("zero_bubble", "1f1b_split") and stage == 3 and not self._keep_gathered:
            raise PipelineError(f"the {self.schedule_name} schedule splits backwards into input and weight halves, "
                                "so at ZeRO stage 3 it keeps a stage's layers gathered across the batch: remove "
                                "pipeline.keep_gathered: false, or use the 1f1b schedule")
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        """What a split backward's weight half computes gradients for (see [Note: split backward])."""
        self._channels: dict[tuple[str, int], Channel | SharedChannel] = {}
        # stages on one host with CPU tensors: transfers through shared memory (collective)
        self._links = open_links(grid.pipe_comm, self._device) if self.num_stages > 1 else None
        self._tied = []
        for key, param, ranks, comm in model.tied_weights():  # the module made the copies equal
            comm.timeout = timedelta(seconds=config.comm.timeout_s)
            param.pipe_copies = len(ranks)
            param.pipe_tied_key = key
            self._tied.append((key, param, comm, {"grad": None}))
        self._install_tied_capture()
        self.data_iterator = None
        if self.training_dataloader is not None:  # initialize(training_data=...): read it forever, as DeepSpeed
            from shardwise.runtime.data import RepeatingLoader

            self.set_dataiterator(RepeatingLoader(self.training_dataloader))
        self.agg_train_loss: torch.Tensor | None = None

    def _channel(self, kind: str, stage: int) -> Channel:
        """The channel carrying ``kind`` ("activation" or "gradient") between this stage and
        ``stage``, one message stream per kind (so the two never interleave)."""
        key = (kind, stage)
        if key not in self._channels:
            what, stream = f"pipeline stage {self.stage_id} <-> stage {stage} {kind}", 0 if kind == "activation" else 1
            if self._links is not None:
                self._channels[key] = SharedChannel(self._links, self.grid.pipe_comm, self.stage_id, stage,
                                                    peer_rank=self.grid.stage_to_global(stage), what=what,
                                                    stream=stream)
            else:
                self._channels[key] = Channel(self.grid.pipe_comm, self.grid.stage_to_global(stage), what=what,
                                              device=self._device, stream=stream)
        return self._channels[key]

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
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) or "
                            "engine.eval_batch(data_iter) instead of engine(...)")

    def backward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch(data_iter); it does "
                            "the backward and the step")

    def step(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch(data_iter); it does "
                            "the backward and the step")

    # -- training ---------------------------------------------------------------------------

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one batch of ``gradient_accumulation_steps`` micro-batches through the
        pipeline, reduce and step; returns the batch's mean loss on every rank."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        actions = sched.build_schedule(self.schedule_name, self.num_stages, self.micro_batches, self.stage_id,
                                       **self.schedule_options)
        run = _BatchRun(self, training=True)
        run.post_receives_ahead(actions)
        with self._kept_gathered():
            for action in actions:
                run.execute(action)
        run.finish()  # every training schedule ends with its OptimizerStep
        self.agg_train_loss = self._batch_loss(run.losses)
        self._progress.record_loss(self.agg_train_loss)
        self._progress.after_model_step()
        return self.agg_train_loss

    @contextlib.contextmanager
    def _kept_gathered(self):
        """ZeRO stage 3: the stage's layers stay gathered across the batch's micro-batches
        (see ``keep_gathered``) unless the config's ``pipeline.keep_gathered`` is false;
        freed before the optimizer step (:meth:`_reduce_and_step`) or on the way out."""
        keep = getattr(self.strategy, "keep_gathered", None)
        if keep is None or not self._keep_gathered:
            yield
            return
        self._holding = keep()
        self._holding.__enter__()
        try:
            yield
        finally:
            self._release_held()

    def _release_held(self) -> None:
        holding, self._holding = self._holding, None
        if holding is not None:
            holding.__exit__(None, None, None)

    def _reduce_and_step(self) -> None:
        if self._tied:
            self._feed_tied_gradients()
        self._release_held()  # the step changes the shards the gathered layers came from
        with self._progress.timer("step"):
            self._take_model_step(None)
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.micro_batches * self.comm.world_size

    def _install_tied_capture(self) -> None:
        """Make every use of a tied weight on this stage go through :class:`_CaptureGrad`."""
        from functools import partial

        for key, param, _, store in self._tied:
            module = self.module.tied_modules[key]
            name = next(n for n, p in module.named_parameters() if p is param)
            owner, attr = _owner(module, name)
            for funcs in self.module.chunk_funcs.values():
                for index, fn in enumerate(funcs):
                    if fn is module or (isinstance(fn, partial) and fn.args and fn.args[0] is module):
                        funcs[index] = _CapturedCall(fn, owner, attr, store)

    def _feed_tied_gradients(self) -> None:
        """Sum the kept tied-weight gradients over the stages holding them and give them to
        the parameters in one backward, the accumulation boundary (see [Note: one batch on
        one stage])."""
        outputs, grads = [], []
        with GatheredParameters([param for _, param, _, _ in self._tied]):  # whole under stage 3
            for key, param, comm, store in self._tied:
                grad = store["grad"] if store["grad"] is not None else torch.zeros_like(param)
                store["grad"] = None
                comm.all_reduce(grad, tag=f"tied weight {key} gradient").wait()
                outputs.append(param * 1.0)
                grads.append(grad)
            self.strategy.pre_backward(boundary=True, sync=True)
            torch.autograd.backward(outputs, grads)
            self.strategy.finalize_backward()

    def _batch_loss(self, losses: list[torch.Tensor], *, broadcast: bool = True) -> torch.Tensor:
        """The batch's mean loss: averaged over micro-batches and data-parallel ranks on the
        last stage, then (``broadcast``) sent to every stage (DeepSpeed's ``agg_train_loss``)."""
        loss = torch.stack([x.float() for x in losses]).mean().reshape(1) if losses \
            else torch.zeros(1, device=self._device)
        loss = loss.to(self._device)
        if self.is_last_stage() and self.comm.world_size > 1:
            self.comm.all_reduce(loss, tag="batch loss").wait()
            loss /= self.comm.world_size
        if broadcast and self.num_stages > 1:
            self.grid.pipe_comm.broadcast(loss, src=self.num_stages - 1, tag="batch loss").wait()
        return loss[0]

    # -- evaluation -------------------------------------------------------------------------

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
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
        run = _BatchRun(self, training=False, compute_loss=compute_loss)
        try:
            with torch.no_grad():
                actions = sched.build_schedule("eval", self.num_stages, micro_batches, self.stage_id,
                                               **self.schedule_options)
                run.post_receives_ahead(actions)
                for action in actions:
                    run.execute(action)
            run.finish()
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


class _BatchRun:
    """The state of one batch on this stage while its actions execute."""

    def __init__(self, engine: PipelineEngine, *, training: bool, compute_loss: bool = True):
        self.e, self.training, self.compute_loss = engine, training, compute_loss
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        self.labels: dict[int, object] = {}
        self.grads_in: dict[int, object] = {}
        self.grads_out: dict[int, object] = {}
        self.losses: list[torch.Tensor] = []
        self.logits: list = []
        self.backwards = 0
        self.chunk_backwards: dict[int, int] = {}
        self.weight_halves: dict[tuple[int, int], object] = {}
        """(micro-batch, chunk) -> what its ``BackwardInput`` left for its ``BackwardWeight``."""
        self.read = 0

    def post_receives_ahead(self, actions) -> None:
        """Count this batch's receives per channel and post the first one's start now (see
        ``Channel.post_ahead``); each receive then posts the next one on its channel."""
        self.receives_left: dict[tuple[str, int], int] = {}
        for a in actions:
            if isinstance(a, (sched.RecvActivation, sched.RecvGrad)):
                key = ("activation" if isinstance(a, sched.RecvActivation) else "gradient", a.from_stage)
                self.receives_left[key] = self.receives_left.get(key, 0) + 1
        for kind, stage in self.receives_left:
            self.e._channel(kind, stage).post_ahead()

    def _received(self, kind: str, stage: int) -> None:
        key = (kind, stage)
        self.receives_left[key] -= 1
        if self.receives_left[key]:
            self.e._channel(kind, stage).post_ahead()

    def execute(self, action) -> None:
        kind = type(action).__name__
        handler = getattr(self, "_" + kind, None)
        if handler is None:
            raise PipelineError(f"the pipeline runtime has no handler for schedule action {action!r}")
        handler(action)

    # -- data ---------------------------------------------------------------------------------

    def _next_micro_batch(self, mb: int):
        e = self.e
        if e.data_iterator is None:
            raise PipelineError("train_batch() needs a data iterator: pass one or call set_dataiterator() (or give "
                                "initialize(training_data=...))")
        try:
            batch = next(e.data_iterator)
        except StopIteration:
            raise PipelineError(f"the data iterator ran out inside a batch: {self.read} of {e.micro_batches} "
                                "micro-batches were read (gradient_accumulation_steps micro-batches per "
                                "train_batch)") from None
        self.read += 1
        device = self.e._device
        batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError(f"micro-batch {mb}: a pipeline data iterator yields (inputs, labels) pairs, got "
                                f"{type(batch).__name__}")
        return batch

    # -- actions --------------------------------------------------------------------------------

    # The transfer timers carry DeepSpeed's pipeline timer names (wall_clock_breakdown); a
    # send's time is that of handing the tensors over, a receive's includes the wait.

    def _RecvActivation(self, a) -> None:  # noqa: N802 -- named after the action
        with self.e._progress.timer("pipe_recv_input"):
            self.inputs[(a.micro_batch, a.chunk)] = self.e._channel("activation", a.from_stage).recv(
                tag=f"micro-batch {a.micro_batch} chunk {a.chunk}")
        self._received("activation", a.from_stage)

    def _SendActivation(self, a) -> None:  # noqa: N802
        key = (a.micro_batch, a.chunk)
        with self.e._progress.timer("pipe_send_output"):
            self.e._channel("activation", a.to_stage).send(self.outputs[key], tag=f"micro-batch {a.micro_batch} "
                                                                                  f"chunk {a.chunk + 1}")
        if not self.training:
            self.outputs.pop(key)

    def _RecvGrad(self, a) -> None:  # noqa: N802
        with self.e._progress.timer("pipe_recv_grad"):
            self.grads_in[(a.micro_batch, a.chunk)] = self.e._channel("gradient", a.from_stage).recv(
                tag=f"micro-batch {a.micro_batch} chunk {a.chunk}")
        self._received("gradient", a.from_stage)

    def _SendGrad(self, a) -> None:  # noqa: N802
        with self.e._progress.timer("pipe_send_grad"):
            self.e._channel("gradient", a.to_stage).send(self.grads_out.pop((a.micro_batch, a.chunk)),
                                                         tag=f"micro-batch {a.micro_batch} chunk {a.chunk - 1}")

    def _Forward(self, a) -> None:  # noqa: N802
        with self.e._progress.timer("forward"):
            self._forward(a.micro_batch, a.chunk)

    def _forward(self, mb: int, chunk: int) -> None:
        e = self.e
        first, last = chunk == 0, chunk == e.module.num_chunks - 1
        if first or last:
            inputs, labels = self._next_micro_batch(mb)
            if first:
                self.inputs[(mb, chunk)] = inputs
            if last:
                self.labels[mb] = labels
        key = (mb, chunk)
        x = self.inputs[key]
        if self.training and first:  # the first stage's inputs need no gradient
            x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)
        args = e.policy.cast_inputs(x if isinstance(x, tuple) else (x,))
        out = e.module(args[0] if len(args) == 1 else args, chunk=chunk)
        if last:
            if self.compute_loss:
                loss_fn = e.module.loss_fn
                loss = loss_fn(out, self.labels.pop(mb)) if loss_fn is not None else out
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise PipelineError("the last stage's loss is not a scalar tensor: give PipelineModule a "
                                        "loss_fn(outputs, labels), or make the last layer return the loss")
                self.losses.append(loss.detach())
                out_for_backward = loss
            else:
                out_for_backward = out
            if not self.training:
                self.logits.append(out.detach() if isinstance(out, torch.Tensor) else out)
            self.outputs[key] = out_for_backward
        else:
            self.outputs[key] = out
        if not self.training:  # nothing is kept for a backward
            self.inputs.pop(key, None)
            if last:
                self.outputs.pop(key, None)

    def _Backward(self, a) -> None:  # noqa: N802
        self._backward(a.micro_batch, a.chunk)

    def _BackwardInput(self, a) -> None:  # noqa: N802
        if self.e.module.activation_checkpoint_interval > 0:  # not split: see [Note: split backward]
            self._backward(a.micro_batch, a.chunk)
            return
        key = (a.micro_batch, a.chunk)
        with self.e._progress.timer("backward"):
            outputs, grads = self._roots(key)
            x = self.inputs.pop(key)
            leaves, spec = tree_flatten(x)
            wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            found, self.weight_halves[key] = backward_input(outputs, grads, wanted, self.e._trainable)
        if a.chunk > 0:
            by_id = {id(t): g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, found)}
            self.grads_out[key] = tree_unflatten([by_id.get(id(t)) for t in leaves], spec)

    def _BackwardWeight(self, a) -> None:  # noqa: N802
        half = self.weight_halves.pop((a.micro_batch, a.chunk), None)
        if half is None:  # the chunk's backward ran whole at its BackwardInput
            return
        with self.e._progress.timer("backward"), self._accumulating(a.chunk):
            half.run()

    def _roots(self, key):
        """The tensors the backward of (micro-batch, chunk) ``key`` starts from, with their
        gradients: the scaled loss on the last chunk, else the outputs that need one."""
        e = self.e
        out = self.outputs.pop(key)
        if key[1] == e.module.num_chunks - 1:
            scaled = out.float() / e.micro_batches
            if e.loss_scaler is not None:
                scaled = scaled * e.loss_scaler.scale
            return [scaled], [None]
        outs, _ = tree_flatten(out)
        gs, _ = tree_flatten(self.grads_in.pop(key))
        pairs = [(o, g) for o, g in zip(outs, gs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(g, torch.Tensor)]
        return [o for o, _ in pairs], [g for _, g in pairs]

    @contextlib.contextmanager
    def _accumulating(self, chunk: int):
        """Around a backward that accumulates parameter gradients (a whole ``Backward`` or a
        ``BackwardWeight``): the ZeRO strategy's hooks, armed to reduce at the right one."""
        e = self.e
        self.backwards += 1
        self.chunk_backwards[chunk] = self.chunk_backwards.get(chunk, 0) + 1
        boundary = self.backwards == e.micro_batches * e.virtual_stages and not e._tied  # else the fed gradient's
        # reduced once: at each chunk's last backward, the one that fires its parameters' hooks for the batch
        sync = self.chunk_backwards[chunk] == e.micro_batches or not e._reduce_once
        e.strategy.pre_backward(boundary=boundary, sync=sync)
        yield
        e.strategy.finalize_backward()

    def _backward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        with self.e._progress.timer("backward"), self._accumulating(chunk):
            outputs, grads = self._roots(key)
            if outputs:
                torch.autograd.backward(outputs, grads)
        x = self.inputs.pop(key)
        if chunk > 0:
            self.grads_out[key] = tree_map(
                lambda t: (t.grad if t.grad is not None else torch.zeros_like(t))
                if isinstance(t, torch.Tensor) and t.requires_grad else None, x)

    def _ReduceGrads(self, a) -> None:  # noqa: N802 -- reduced with the boundary backward
        pass

    def _OptimizerStep(self, a) -> None:  # noqa: N802
        self.finish()
        self.e._reduce_and_step()

    def finish(self) -> None:
        """Wait for the sends still in flight."""
        for channel in self.e._channels.values():
            channel.finish()


def _owner(module: torch.nn.Module, dotted: str):
    *path, name = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


class _CapturedCall:
    """Call ``fn`` with ``owner.<attr>`` seen as ``_CaptureGrad(param)`` for the call."""

    def __init__(self, fn, owner: torch.nn.Module, attr: str, store: dict):
        self.fn, self.owner, self.attr, self.store = fn, owner, attr, store

    def __call__(self, x):
        param = self.owner._parameters[self.attr]
        # under ZeRO stage 3 the weight is gathered before the capture reads it (the module's
        # own pre-forward hook would gather it only inside fn); its backward gathers it again
        with GatheredParameters([param]):
            del self.owner._parameters[self.attr]
            try:
                self.owner.__dict__[self.attr] = _CaptureGrad.apply(param, self.store)
                out = self.fn(x)
            finally:
                self.owner.__dict__.pop(self.attr, None)
                self.owner._parameters[self.attr] = param
        owner = getattr(param, "_shardwise_unit", None)
        if owner is not None:  # a forward_fn need not call the module, whose hooks would gather it for backward
            strategy, unit = owner
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(_gather_first(strategy, unit))
        return out


def _gather_first(strategy, unit):
    """A gradient hook that gathers ``unit`` (stage 3) before the backward that reads it."""
    def hook(grad):
        strategy.gather_units([unit])
        return grad
    return hook
