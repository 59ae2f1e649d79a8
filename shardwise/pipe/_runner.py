"""The stage runner: executes a schedule's actions for one batch on this stage.

[Note: one batch on one stage]
``PipelineEngine.train_batch`` builds this stage's action list from the schedule (a pure
function, see ``schedules.py``) and hands it to the :class:`StageRunner` the engine holds,
which executes it: the first and the last stage read each micro-batch ``(inputs, labels)``
from the data iterator (inputs feed the first stage, labels the loss on the last);
activations and gradients travel as pytrees over the pipe axis (see [Note: pytree
transfers with a shape handshake] in ``_transfer.py``; between stages on one host with
CPU tensors, [Note: pipeline transfers through shared memory] in ``_shared_transfer.py``).
A split schedule's ``BackwardInput`` and ``BackwardWeight`` run the two halves of [Note:
split backward]. Each backward goes through the ZeRO strategy like the ordinary engine's,
with the last micro-batch's backward as the accumulation boundary, so gradients are
reduced over the data-parallel group once per batch, overlapped with that backward. The
loss of every micro-batch is divided by their number, so the step sees the batch's mean
gradient. Tied weights: [Note: tied weights in a pipeline] in ``_tied.py``.

Each action type of ``_actions.py`` has one handler in :data:`HANDLERS`, a table checked
against the ``Action`` union when this module is imported, so an action without a
handler fails at import rather than when a schedule first emits it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from shardwise.accelerator import get_accelerator
from shardwise.pipe._actions import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)
from shardwise.pipe._shared_transfer import SharedChannel, open_links
from shardwise.pipe._split_backward import backward_input
from shardwise.pipe._tied import TiedWeights
from shardwise.pipe._transfer import Channel
from shardwise.pipe.module import PipelineError, PipelineModule


@dataclass(frozen=True)
class StageParts:
    """What the runner uses of the engine holding it; it reads them, never replaces them."""

    module: PipelineModule
    grid: Any
    """The engine's ``ParallelGrid`` (pipe group, stage ranks)."""
    strategy: Any
    """The engine's ZeRO strategy: each backward is armed through it."""
    policy: Any
    """The engine's ``PrecisionPolicy`` (inputs cast before each chunk's forward)."""
    loss_scaler: Any
    """The engine's fp16 ``LossScaler``, or None."""
    timer: Callable[..., contextlib.AbstractContextManager]
    """A timer context by DeepSpeed's timer name (wall_clock_breakdown); ``partial=True``
    marks a part of a phase (``ProgressReporter.timer``)."""
    step: Callable[[], None]
    """The optimizer step of the batch, after its gradients are complete."""


class StageRunner:
    """Runs pipeline batches on this stage: its channels to the other stages, its tied
    weights, and (ZeRO 3) its layers kept gathered across a batch."""

    def __init__(self, parts: StageParts, *, keep_gathered: bool, reduce_once: bool, timeout_s: float):
        self.parts = parts
        self.device = get_accelerator().device()
        self.keep_gathered = keep_gathered
        self.reduce_once = reduce_once
        """Gradients accumulate whole over the batch and are reduced at its last backward."""
        self.trainable = [p for p in parts.module.parameters() if p.requires_grad]
        """What a split backward's weight half computes gradients for (see [Note: split backward])."""
        self.channels: dict[tuple[str, int], Channel | SharedChannel] = {}
        num_stages = parts.grid.pipe
        # stages on one host with CPU tensors: transfers through shared memory (collective)
        self._links = open_links(parts.grid.pipe_comm, self.device) if num_stages > 1 else None
        self.tied = TiedWeights(parts.module, timeout_s=timeout_s)
        self._holding = None

    def channel(self, kind: str, stage: int) -> Channel | SharedChannel:
        """The channel carrying ``kind`` ("activation" or "gradient") between this stage and
        ``stage``, one message stream per kind (so the two never interleave)."""
        key = (kind, stage)
        if key not in self.channels:
            grid, me = self.parts.grid, self.parts.grid.stage_id
            what, stream = f"pipeline stage {me} <-> stage {stage} {kind}", 0 if kind == "activation" else 1
            if self._links is not None:
                self.channels[key] = SharedChannel(
                    self._links,
                    grid.pipe_comm,
                    me,
                    stage,
                    peer_rank=grid.stage_to_global(stage),
                    what=what,
                    stream=stream,
                )
            else:
                self.channels[key] = Channel(
                    grid.pipe_comm, grid.stage_to_global(stage), what=what, device=self.device, stream=stream
                )
        return self.channels[key]

    def run(
        self,
        actions: list[Action],
        data: Iterator | None,
        *,
        training: bool,
        micro_batches: int,
        compute_loss: bool = True,
    ) -> _BatchRun:
        """Execute ``actions`` (one batch of ``micro_batches`` read from ``data``) and wait
        for the sends still in flight; returns the batch's state (its losses and logits)."""
        run = _BatchRun(self, data, training=training, micro_batches=micro_batches, compute_loss=compute_loss)
        run.post_receives_ahead(actions)
        with self._kept_gathered() if training else contextlib.nullcontext():
            for action in actions:
                run.execute(action)
        run.finish()
        return run

    @contextlib.contextmanager
    def _kept_gathered(self):
        """ZeRO stage 3: the stage's layers stay gathered across the batch's micro-batches
        (see ``keep_gathered``) unless the config's ``pipeline.keep_gathered`` is false;
        freed before the optimizer step (:meth:`step`) or on the way out."""
        keep = getattr(self.parts.strategy, "keep_gathered", None)
        if keep is None or not self.keep_gathered:
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

    def step(self) -> None:
        """Complete the gradients (tied weights fed) and step the optimizer."""
        if self.tied:
            self.tied.feed_gradients(self.parts.strategy)
        self._release_held()  # the step changes the shards the gathered layers came from
        self.parts.step()


class _BatchRun:
    """The state of one batch on this stage while its actions execute."""

    def __init__(
        self, runner: StageRunner, data: Iterator | None, *, training: bool, micro_batches: int, compute_loss: bool
    ):
        self.runner, self.parts, self.data = runner, runner.parts, data
        self.training, self.micro_batches, self.compute_loss = training, micro_batches, compute_loss
        self.inputs: dict[tuple[int, int], object] = {}
        self.outputs: dict[tuple[int, int], object] = {}
        self.labels: dict[int, object] = {}
        self.grads_in: dict[tuple[int, int], object] = {}
        self.grads_out: dict[tuple[int, int], object] = {}
        self.losses: list[torch.Tensor] = []
        self.logits: list = []
        self.backwards = 0
        self.chunk_backwards: dict[int, int] = {}
        self.weight_halves: dict[tuple[int, int], object] = {}
        """(micro-batch, chunk) -> what its ``BackwardInput`` left for its ``BackwardWeight``."""
        self.read = 0
        self.receives_left: dict[tuple[str, int], int] = {}

    def post_receives_ahead(self, actions: list[Action]) -> None:
        """Count this batch's receives per channel and post the first one's start now (see
        ``Channel.post_ahead``); each receive then posts the next one on its channel."""
        for a in actions:
            if isinstance(a, (RecvActivation, RecvGrad)):
                key = ("activation" if isinstance(a, RecvActivation) else "gradient", a.from_stage)
                self.receives_left[key] = self.receives_left.get(key, 0) + 1
        for kind, stage in self.receives_left:
            self.runner.channel(kind, stage).post_ahead()

    def _received(self, kind: str, stage: int) -> None:
        key = (kind, stage)
        self.receives_left[key] -= 1
        if self.receives_left[key]:
            self.runner.channel(kind, stage).post_ahead()

    def execute(self, action: Action) -> None:
        """Run ``action`` through its handler in :data:`HANDLERS`."""
        handler = HANDLERS.get(type(action))
        if handler is None:  # not an action of _actions.py (HANDLERS covers all of them)
            raise PipelineError(f"the pipeline runtime has no handler for schedule action {action!r}")
        handler(self, action)

    def finish(self) -> None:
        """Wait for the sends still in flight."""
        for channel in self.runner.channels.values():
            channel.finish()

    def _next_micro_batch(self, mb: int):
        if self.data is None:
            raise PipelineError(
                "train_batch() needs a data iterator: pass one or call set_dataiterator() (or give "
                "initialize(training_data=...))"
            )
        try:
            batch = next(self.data)
        except StopIteration:
            raise PipelineError(
                f"the data iterator ran out inside a batch: {self.read} of {self.micro_batches} "
                "micro-batches were read (gradient_accumulation_steps micro-batches per "
                "train_batch)"
            ) from None
        self.read += 1
        device = self.runner.device
        batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError(
                f"micro-batch {mb}: a pipeline data iterator yields (inputs, labels) pairs, got {type(batch).__name__}"
            )
        return batch

    # -- transfers: the timers carry DeepSpeed's pipeline timer names (wall_clock_breakdown);
    # a send's time is that of handing the tensors over, a receive's includes the wait

    def recv_activation(self, a: RecvActivation) -> None:
        with self.parts.timer("pipe_recv_input"):
            self.inputs[(a.micro_batch, a.chunk)] = self.runner.channel("activation", a.from_stage).recv(
                tag=f"micro-batch {a.micro_batch} chunk {a.chunk}"
            )
        self._received("activation", a.from_stage)

    def send_activation(self, a: SendActivation) -> None:
        key = (a.micro_batch, a.chunk)
        with self.parts.timer("pipe_send_output"):
            self.runner.channel("activation", a.to_stage).send(
                self.outputs[key], tag=f"micro-batch {a.micro_batch} chunk {a.chunk + 1}"
            )
        if not self.training:
            self.outputs.pop(key)

    def recv_grad(self, a: RecvGrad) -> None:
        with self.parts.timer("pipe_recv_grad"):
            self.grads_in[(a.micro_batch, a.chunk)] = self.runner.channel("gradient", a.from_stage).recv(
                tag=f"micro-batch {a.micro_batch} chunk {a.chunk}"
            )
        self._received("gradient", a.from_stage)

    def send_grad(self, a: SendGrad) -> None:
        with self.parts.timer("pipe_send_grad"):
            self.runner.channel("gradient", a.to_stage).send(
                self.grads_out.pop((a.micro_batch, a.chunk)), tag=f"micro-batch {a.micro_batch} chunk {a.chunk - 1}"
            )

    # -- compute ------------------------------------------------------------------------------

    def forward(self, a: Forward) -> None:
        with self.parts.timer("forward"):
            self._forward_chunk(a.micro_batch, a.chunk)

    def _forward_chunk(self, mb: int, chunk: int) -> None:
        module = self.parts.module
        first, last = chunk == 0, chunk == module.num_chunks - 1
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
        args = self.parts.policy.cast_inputs(x if isinstance(x, tuple) else (x,))
        out = module(args[0] if len(args) == 1 else args, chunk=chunk)
        if last:
            if self.compute_loss:
                loss = module.loss_fn(out, self.labels.pop(mb)) if module.loss_fn is not None else out
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise PipelineError(
                        "the last stage's loss is not a scalar tensor: give PipelineModule a "
                        "loss_fn(outputs, labels), or make the last layer return the loss"
                    )
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

    def backward(self, a: Backward) -> None:
        self._backward_whole(a.micro_batch, a.chunk)

    def backward_input(self, a: BackwardInput) -> None:
        if self.parts.module.activation_checkpoint_interval > 0:  # not split: see [Note: split backward]
            self._backward_whole(a.micro_batch, a.chunk)
            return
        key = (a.micro_batch, a.chunk)
        with self.parts.timer("backward", partial=True):  # the weight half ends the backward
            outputs, grads = self._roots(key)
            x = self.inputs.pop(key)
            leaves, spec = tree_flatten(x)
            wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            found, self.weight_halves[key] = backward_input(outputs, grads, wanted, self.runner.trainable)
        if a.chunk > 0:
            by_id = {id(t): g if g is not None else torch.zeros_like(t) for t, g in zip(wanted, found)}
            self.grads_out[key] = tree_unflatten([by_id.get(id(t)) for t in leaves], spec)

    def backward_weight(self, a: BackwardWeight) -> None:
        half = self.weight_halves.pop((a.micro_batch, a.chunk), None)
        if half is None:  # the chunk's backward ran whole at its BackwardInput
            return
        with self.parts.timer("backward"), self._accumulating(a.chunk):
            half.run()

    def _roots(self, key):
        """The tensors the backward of (micro-batch, chunk) ``key`` starts from, with their
        gradients: the scaled loss on the last chunk, else the outputs that need one."""
        out = self.outputs.pop(key)
        if key[1] == self.parts.module.num_chunks - 1:
            scaled = out.float() / self.micro_batches
            if self.parts.loss_scaler is not None:
                scaled = scaled * self.parts.loss_scaler.scale
            return [scaled], [None]
        outs, _ = tree_flatten(out)
        gs, _ = tree_flatten(self.grads_in.pop(key))
        pairs = [
            (o, g)
            for o, g in zip(outs, gs)
            if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(g, torch.Tensor)
        ]
        return [o for o, _ in pairs], [g for _, g in pairs]

    @contextlib.contextmanager
    def _accumulating(self, chunk: int):
        """Around a backward that accumulates parameter gradients (a whole ``Backward`` or a
        ``BackwardWeight``): the ZeRO strategy's hooks, armed to reduce at the right one."""
        self.backwards += 1
        self.chunk_backwards[chunk] = self.chunk_backwards.get(chunk, 0) + 1
        # with tied weights the fed gradient's backward is the boundary (see _tied.py)
        boundary = self.backwards == self.micro_batches * self.parts.module.virtual_stages and not self.runner.tied
        # reduced once: at each chunk's last backward, the one that fires its parameters' hooks for the batch
        sync = self.chunk_backwards[chunk] == self.micro_batches or not self.runner.reduce_once
        self.parts.strategy.pre_backward(boundary=boundary, sync=sync)
        yield
        self.parts.strategy.finalize_backward()

    def _backward_whole(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        with self.parts.timer("backward"), self._accumulating(chunk):
            outputs, grads = self._roots(key)
            if outputs:
                torch.autograd.backward(outputs, grads)
        x = self.inputs.pop(key)
        if chunk > 0:
            self.grads_out[key] = tree_map(
                lambda t: (
                    (t.grad if t.grad is not None else torch.zeros_like(t))
                    if isinstance(t, torch.Tensor) and t.requires_grad
                    else None
                ),
                x,
            )

    # -- the step -------------------------------------------------------------------------------

    def reduce_grads(self, a: ReduceGrads) -> None:
        """Nothing to do: the gradients were reduced with the boundary backward."""

    def optimizer_step(self, a: OptimizerStep) -> None:
        self.finish()
        self.runner.step()


HANDLERS: dict[type, Callable[[_BatchRun, Any], None]] = {
    Forward: _BatchRun.forward,
    Backward: _BatchRun.backward,
    BackwardInput: _BatchRun.backward_input,
    BackwardWeight: _BatchRun.backward_weight,
    SendActivation: _BatchRun.send_activation,
    RecvActivation: _BatchRun.recv_activation,
    SendGrad: _BatchRun.send_grad,
    RecvGrad: _BatchRun.recv_grad,
    ReduceGrads: _BatchRun.reduce_grads,
    OptimizerStep: _BatchRun.optimizer_step,
}
"""The handler of every schedule action type (DeepSpeed's ``_INSTRUCTION_MAP``)."""


def check_handlers(handlers: dict[type, Callable]) -> None:
    """Raise :class:`PipelineError` unless ``handlers`` has exactly the action types of
    ``_actions.Action``, naming those missing or foreign."""
    declared = set(get_args(Action))
    missing = sorted(t.__name__ for t in declared - set(handlers))
    foreign = sorted(getattr(t, "__name__", repr(t)) for t in set(handlers) - declared)
    if missing or foreign:
        raise PipelineError(
            f"the pipeline runner's handler table does not match _actions.Action: missing "
            f"{missing or 'none'}, not actions {foreign or 'none'}"
        )


check_handlers(HANDLERS)
