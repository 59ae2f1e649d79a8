"""The action vocabulary of pipeline schedules: what one stage does, in order.

[Note: pipeline chunks]
A model is cut into ``num_stages * virtual_stages`` consecutive pieces called *chunks*
(virtual stages). Every action's ``chunk`` is the chunk's *global* index, and chunk ``k``
always lives on stage ``k % num_stages``: stage ``s`` holds chunks ``s, s + p, s + 2p, ...``
(``p`` = number of stages). Without interleaving (``virtual_stages=1``) the chunk of every
action on stage ``s`` is ``s``. An action only ever names a chunk its own stage holds, so a
runtime maps ``chunk -> module`` with one dict lookup and no arithmetic:
- ``SendActivation(mb, k, to_stage)`` sends chunk ``k``'s forward output to chunk ``k + 1``;
  the matching ``RecvActivation(mb, k + 1, from_stage)`` receives it as chunk ``k + 1``'s
  input.
- ``SendGrad(mb, k, to_stage)`` sends the gradient w.r.t. chunk ``k``'s input to chunk
  ``k - 1``; the matching ``RecvGrad(mb, k - 1, from_stage)`` receives it as the gradient of
  chunk ``k - 1``'s output.
``message_key`` names the message both sides of a pair agree on. Consecutive chunks that
sit on the same stage (only when ``num_stages == 1``) hand tensors over in memory: no
send/receive actions are emitted for them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    """Run chunk ``chunk``'s forward on micro-batch ``micro_batch`` and keep its activations."""

    micro_batch: int
    chunk: int

    def __str__(self) -> str:
        return f"F(mb={self.micro_batch}, chunk={self.chunk})"


@dataclass(frozen=True)
class Backward:
    """Whole backward of one micro-batch through one chunk: input and weight gradients.

    Frees the micro-batch's activations; the previous chunk waits for its input gradient.
    """

    micro_batch: int
    chunk: int

    def __str__(self) -> str:
        return f"B(mb={self.micro_batch}, chunk={self.chunk})"


@dataclass(frozen=True)
class BackwardInput:
    """Gradient w.r.t. the chunk's input only (what the previous chunk waits for).

    Keeps what ``BackwardWeight`` of the same micro-batch needs (layer inputs and output
    gradients); frees the rest of the micro-batch's activations.
    """

    micro_batch: int
    chunk: int

    def __str__(self) -> str:
        return f"BI(mb={self.micro_batch}, chunk={self.chunk})"


@dataclass(frozen=True)
class BackwardWeight:
    """Parameter gradients of one micro-batch through one chunk; after its ``BackwardInput``.

    Accumulates into the chunk's gradients and frees the micro-batch's last activations.
    """

    micro_batch: int
    chunk: int

    def __str__(self) -> str:
        return f"BW(mb={self.micro_batch}, chunk={self.chunk})"


@dataclass(frozen=True)
class SendActivation:
    """Send chunk ``chunk``'s forward output for ``micro_batch`` to ``to_stage`` (non-blocking)."""

    micro_batch: int
    chunk: int
    to_stage: int

    def __str__(self) -> str:
        return f"SendAct(mb={self.micro_batch}, chunk={self.chunk}, to={self.to_stage})"


@dataclass(frozen=True)
class RecvActivation:
    """Wait for chunk ``chunk``'s input for ``micro_batch`` from ``from_stage``."""

    micro_batch: int
    chunk: int
    from_stage: int

    def __str__(self) -> str:
        return f"RecvAct(mb={self.micro_batch}, chunk={self.chunk}, from={self.from_stage})"


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient w.r.t. chunk ``chunk``'s input to ``to_stage`` (non-blocking)."""

    micro_batch: int
    chunk: int
    to_stage: int

    def __str__(self) -> str:
        return f"SendGrad(mb={self.micro_batch}, chunk={self.chunk}, to={self.to_stage})"


@dataclass(frozen=True)
class RecvGrad:
    """Wait for the gradient of chunk ``chunk``'s output for ``micro_batch`` from ``from_stage``."""

    micro_batch: int
    chunk: int
    from_stage: int

    def __str__(self) -> str:
        return f"RecvGrad(mb={self.micro_batch}, chunk={self.chunk}, from={self.from_stage})"


@dataclass(frozen=True)
class ReduceGrads:
    """Chunk ``chunk``'s gradients are complete: start their data-parallel reduction.

    Placed right after the chunk's last weight-gradient action. The reduction is
    asynchronous: later backward work of other chunks (interleaved schedules) and of later
    micro-batches' sends overlaps it, and ``OptimizerStep`` waits for it. A runtime whose
    gradient hooks already reduce buckets during that last backward treats this as the
    point to flush the remaining buckets.
    """

    chunk: int

    def __str__(self) -> str:
        return f"ReduceGrads(chunk={self.chunk})"


@dataclass(frozen=True)
class OptimizerStep:
    """Wait for every ``ReduceGrads`` of the stage, then step the optimizer (once per batch)."""

    def __str__(self) -> str:
        return "OptimizerStep()"


Action = (
    Forward
    | Backward
    | BackwardInput
    | BackwardWeight
    | SendActivation
    | RecvActivation
    | SendGrad
    | RecvGrad
    | ReduceGrads
    | OptimizerStep
)
"""Any schedule action."""

COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
"""Action types that occupy the stage's compute (the rest are waits or launches)."""
WEIGHT_GRAD = (Backward, BackwardWeight)
"""Action types that accumulate parameter gradients."""
INPUT_GRAD = (Backward, BackwardInput)
"""Action types that produce the gradient w.r.t. the chunk's input."""

_SHORT = {
    Forward: "F",
    Backward: "B",
    BackwardInput: "BI",
    BackwardWeight: "BW",
    SendActivation: "sa",
    RecvActivation: "ra",
    SendGrad: "sg",
    RecvGrad: "rg",
}


def label(action: Action, *, show_chunk: bool = False) -> str:
    """Compact label for tables: ``F3``, ``BI3``, ``F3c5`` (chunk 5), ``ra3``, ``R`` (reduce), ``S`` (step)."""
    if isinstance(action, ReduceGrads):
        return f"R{action.chunk}" if show_chunk else "R"
    if isinstance(action, OptimizerStep):
        return "S"
    text = f"{_SHORT[type(action)]}{action.micro_batch}"
    return f"{text}c{action.chunk}" if show_chunk else text


def message_key(action: Action) -> tuple[str, int, int] | None:
    """``(kind, micro_batch, sending chunk)`` shared by a send and its receive; None otherwise.

    See [Note: pipeline chunks] for why the two sides name neighbouring chunks.
    """
    if isinstance(action, SendActivation):
        return ("activation", action.micro_batch, action.chunk)
    if isinstance(action, RecvActivation):
        return ("activation", action.micro_batch, action.chunk - 1)
    if isinstance(action, SendGrad):
        return ("grad", action.micro_batch, action.chunk)
    if isinstance(action, RecvGrad):
        return ("grad", action.micro_batch, action.chunk + 1)
    return None
