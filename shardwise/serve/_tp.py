"""Tensor-parallel serving: the batching engine over a model split across ranks.

[Note: tensor-parallel serving]
Every rank of the tensor group holds its shard of the model, split by ``init_inference``'s
tensor parallelism (q/k/v and gate/up by heads and columns, o and down by rows with an
all-reduce, the LM head by vocabulary with its logits gathered), and a paged KV cache of
its own heads only. Rank 0 runs the whole engine: requests, the scheduler, sampling. Every
step it packs the step's plan (:class:`~shardwise.serve._paged.StepPlan`: the flat token
ids, each chunk's start, end, whether it samples and its block table; positions, written
slots and context slots follow from those) into one int64 tensor of a fixed size
(:class:`PlanFormat`) and broadcasts it: one broadcast per step. Every rank, rank 0
included, unpacks that same tensor and runs the same paged forward over its heads; the
row-parallel all-reduces combine the heads, and rank 0 samples from the gathered logits.

Each message carries a step number the followers check, and an op: ``RUN`` a forward,
``IDLE`` a heartbeat that rank 0 sends while it has nothing to compute (so a follower's
wait for the next plan, bounded by the communicator's deadline like every collective,
never expires on an idle server), ``STOP`` the end (followers return). Failures: a
follower that dies closes its sockets, so rank 0's next broadcast or all-reduce fails (a
stuck one fails at the deadline); the engine then fails every request it holds with the
error and refuses new ones with it (see ``BatchingEngine``); a follower whose rank 0 dies
fails the same way and ends.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwise.serve._paged import PagedDecoder, StepPlan

if TYPE_CHECKING:
    from shardwise.serve._batching import BatchingConfig

logger = logging.getLogger("shardwise.serve")

RUN, IDLE, STOP = 1, 2, 3
_HEADER = 5
"""step, op, tokens, chunks, block-table entries."""


@dataclass(frozen=True)
class PlanFormat:
    """The fixed-size int64 layout of one step's message (the same on every rank).

    Layout: header (step, op, tokens T, chunks C, table entries B), then T token ids, then
    per chunk its start, end, samples (0/1) and table length, then the B table entries."""

    token_budget: int
    max_num_seqs: int
    max_blocks: int
    """Blocks of the longest sequence (``ceil(max_model_len / block_size)``)."""

    @property
    def size(self) -> int:
        return _HEADER + self.token_budget + 4 * self.max_num_seqs + self.max_num_seqs * self.max_blocks

    def pack(self, plan: StepPlan | None, step: int, op: int) -> torch.Tensor:
        """The message for ``plan`` (None for ``IDLE`` and ``STOP``)."""
        buffer = torch.zeros(self.size, dtype=torch.long)
        if plan is None:
            buffer[:2] = torch.tensor([step, op])
            return buffer
        chunks, tables = len(plan.starts), [b for table in plan.tables for b in table]
        if len(plan.ids) > self.token_budget or chunks > self.max_num_seqs:
            raise ValueError(
                f"a plan of {len(plan.ids)} tokens in {chunks} chunks exceeds the format's "
                f"{self.token_budget} tokens and {self.max_num_seqs} chunks"
            )
        per_chunk = [v for row in zip(plan.starts, plan.ends, plan.samples, map(len, plan.tables)) for v in row]
        values = [step, op, len(plan.ids), chunks, len(tables), *plan.ids, *per_chunk, *tables]
        buffer[: len(values)] = torch.tensor(values, dtype=torch.long)
        return buffer

    def unpack(self, buffer: torch.Tensor) -> tuple[int, int, StepPlan | None]:
        """(step, op, plan) of a message; the plan is None unless op is ``RUN``."""
        values = buffer.tolist()
        step, op, tokens, chunks, _ = values[:_HEADER]
        if op != RUN:
            return step, op, None
        ids = values[_HEADER : _HEADER + tokens]
        at = _HEADER + tokens
        rows = [values[at + 4 * i : at + 4 * i + 4] for i in range(chunks)]
        at += 4 * chunks
        tables = []
        for row in rows:
            tables.append(values[at : at + row[3]])
            at += row[3]
        plan = StepPlan(
            ids=ids,
            starts=[r[0] for r in rows],
            ends=[r[1] for r in rows],
            samples=[bool(r[2]) for r in rows],
            tables=tables,
        )
        return step, op, plan


class PlanBroadcaster:
    """Rank 0's decoder: sends each step's plan to the followers, then runs it itself (see
    [Note: tensor-parallel serving]). ``failed`` holds the error once a collective failed:
    the group is then unusable and the engine stops."""

    def __init__(self, decoder: PagedDecoder, comm, plan_format: PlanFormat, *, heartbeat_s: float):
        self.decoder = decoder
        self.comm = comm
        self.format = plan_format
        self.heartbeat_s = heartbeat_s
        self.failed: str | None = None
        self._step = 0
        self._last_sent = time.monotonic()
        self._closed = False

    def forward(self, chunks) -> torch.Tensor:
        """Logits of the step's sampling chunks (see ``PagedDecoder.forward``)."""
        message = self._send(StepPlan.of(chunks, self.decoder.block_size), RUN)
        return self._guarded(lambda: self.decoder.run(self.format.unpack(message)[2]))

    def idle(self) -> None:
        """A heartbeat when nothing was sent for ``heartbeat_s``."""
        if time.monotonic() - self._last_sent >= self.heartbeat_s:
            self._send(None, IDLE)

    def close(self) -> None:
        """Tell the followers to return (once; not after a failure)."""
        if not self._closed and self.failed is None:
            self._closed = True
            self._send(None, STOP)

    def _send(self, plan: StepPlan | None, op: int) -> torch.Tensor:
        message = self.format.pack(plan, self._step, op)
        self._step += 1
        self._last_sent = time.monotonic()
        device_message = message.to(self.decoder.keys.device)
        self._guarded(lambda: self.comm.broadcast(device_message, src=0, tag="serving plan").wait())
        return message

    def _guarded(self, action):
        if self.failed is not None:
            raise RuntimeError(self.failed)
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - any failure here leaves the group unusable
            self.failed = f"the tensor-parallel group failed: {type(error).__name__}: {error}"
            raise RuntimeError(self.failed) from error


def follow(decoder: PagedDecoder, comm, plan_format: PlanFormat) -> int:
    """A follower's loop: receive each message, check its step number, run ``RUN`` plans,
    return at ``STOP``; the number of forwards run."""
    message = torch.zeros(plan_format.size, dtype=torch.long, device=decoder.keys.device)
    expected, forwards = 0, 0
    while True:
        comm.broadcast(message, src=0, tag="serving plan").wait()
        step, op, plan = plan_format.unpack(message.cpu())
        if step != expected:
            raise RuntimeError(f"tensor-parallel serving: rank {comm.rank} got step {step}, expected {expected}")
        expected += 1
        if op == STOP:
            return forwards
        if op == RUN:
            decoder.run(plan)
            forwards += 1


@dataclass(frozen=True)
class TensorParallelOptions:
    """How the tensor group talks (the engine's own options go to ``BatchingEngine``)."""

    timeout_s: float = 60.0
    """Deadline of every collective, the plan's broadcast included."""
    heartbeat_s: float = 5.0
    """Rank 0 sends an ``IDLE`` message after this long without one; keep it well under
    ``timeout_s``."""


def serve_tensor_parallel(
    model,
    tokenizer,
    *,
    options: TensorParallelOptions | None = None,
    config: BatchingConfig | None = None,
    **engine_kwargs,
):
    """Run a tensor-parallel batching engine over every rank of the default process group.

    Every rank calls this with the same model (same weights) and arguments. Rank 0 returns
    the running :class:`~shardwise.serve._batching.BatchingEngine`; every other rank serves
    as a follower until that engine shuts down, then returns None. ``config`` and
    ``engine_kwargs`` are ``BatchingEngine``'s (``max_model_len``, ``max_queue``, and
    :class:`~shardwise.serve._batching.BatchingConfig`'s fields as keywords). Steps run
    eagerly: the all-reduces of a tensor-parallel step are not captured in CUDA graphs. See
    [Note: tensor-parallel serving]."""
    import shardwise
    from shardwise.comm import Communicator
    from shardwise.serve._batching import BatchingConfig, BatchingEngine

    options = options or TensorParallelOptions()
    tp = dist.get_world_size()
    comm = Communicator(None, timeout_s=options.timeout_s, name="tensor-parallel serving", check_hangs=False)
    dtype = next(model.parameters()).dtype
    shardwise.init_inference(
        model,
        dtype=dtype,
        tensor_parallel={"tp_size": tp, "tp_group": comm},
        replace_with_kernel_inject=False,
        enable_cuda_graph=False,
    )
    max_model_len = engine_kwargs.pop("max_model_len", None) or getattr(model.config, "max_position_embeddings", 2048)
    fields = {f.name for f in dataclasses.fields(BatchingConfig)}
    config = dataclasses.replace(
        config or BatchingConfig(), **{k: engine_kwargs.pop(k) for k in fields & set(engine_kwargs)}
    )
    num_blocks = config.pool_blocks(max_model_len)  # every rank builds the same pool from these
    budget = config.budget_on(next(model.parameters()).device)
    plan_format = PlanFormat(budget, config.max_num_seqs, -(-max_model_len // config.block_size))
    if comm.rank != 0:
        decoder = PagedDecoder(model, num_blocks=num_blocks, block_size=config.block_size)
        forwards = follow(decoder, comm, plan_format)
        logger.info("tensor-parallel follower %d stopped after %d forwards", comm.rank, forwards)
        return None

    def decoder(model, *, num_blocks, block_size):
        paged = PagedDecoder(model, num_blocks=num_blocks, block_size=block_size)
        return PlanBroadcaster(paged, comm, plan_format, heartbeat_s=options.heartbeat_s)

    return BatchingEngine(
        model, tokenizer, max_model_len=max_model_len, config=config, decoder=decoder, **engine_kwargs
    )
