"""The batching engine's decode-only steps with fixed shapes: padded to buckets, replayed as
CUDA graphs on a GPU.

[Note: decode graphs across batches]
On a GPU a decode step of a small model is bound by kernel launches (see [Note: decode graphs]
in ``inference/_graphs.py`` for the technique: static input buffers, warm-up on a side stream,
capture, replay). The batching engine's batch changes at every step (requests join and
leave, each sequence grows), so a step's shape is rounded up to a *bucket* and one graph is
captured per bucket, lazily on its first use, and kept:

- rows: the number of one-token chunks, rounded up to a power of two and capped at
  ``max_num_seqs`` (1, 2, 4, 8, 16 for 16), so at most ``log2(max_num_seqs) + 1`` sizes;
- context: the blocks of the longest sequence, rounded up to a power of two and capped at
  the blocks of ``max_model_len``. Padding the context to ``max_model_len`` instead would
  need one graph per row bucket, but every step would gather and attend over the whole
  length (at 4096 tokens and 32 rows, gigabytes of keys a step); powers of two keep the
  padding under 2x the longest sequence, which the eager step pads to anyway, for at most
  ``log2(blocks) + 1`` graphs per row bucket.

A step's whole input is one int64 tensor on the device (the graph reads it): each row's
token id, its sequence length and its block table padded to the bucket. Positions, the
written slot, the context slots and the mask are computed from it inside the graph, with the
eager step's own layer code (``PagedDecoder.decode_layers``), so both compute the same
thing. Padded rows have token 0, length 1 and a table of the *scratch block* only (a block
the KV pool holds beyond the allocator's, see ``PagedDecoder``): they write and read the
scratch block's first slot and nothing else, and their outputs are dropped. A real row's
table is padded with the scratch block too; those slots are masked, and they hold finite
values (zeros, or the padded rows' keys), so a masked weight of zero never meets a NaN.

Only the decoder layers are captured: the final norm and the LM head run eagerly on the rows
that sample, as in the eager step, so each graph keeps a ``[rows, hidden]`` output and not
a ``[rows, vocab]`` one. All graphs share one memory pool, so their intermediates take the
memory of the largest one: they never run at once, and a step's output is read (its sampling
rows copied out) before the next replay, which may reuse that memory. Mixed steps
(prompt chunks) and steps on a CPU run eagerly; on a CPU a bucket runs its body without a
graph (the same code, which is how the buckets are tested without a GPU).
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass

import torch

logger = logging.getLogger("shardwise.serve")


@dataclass(frozen=True)
class DecodeBuckets:
    """The largest bucket of each kind (see [Note: decode graphs across batches])."""

    max_rows: int
    """Rows of a step at most (the engine's ``max_num_seqs``)."""
    max_blocks: int
    """Context blocks at most (the blocks of ``max_model_len``)."""

    def __post_init__(self):
        if self.max_rows < 1 or self.max_blocks < 1:
            raise ValueError(f"max_rows and max_blocks must be positive, got {self.max_rows} and {self.max_blocks}")


def bucket(n: int, limit: int) -> int:
    """The bucket of ``n``: the smallest power of two that is ``>= n``, or ``limit`` when that
    is larger than ``limit``."""
    if not 1 <= n <= limit:
        raise ValueError(f"no bucket holds {n}: buckets hold 1..{limit}")
    return min(1 << (n - 1).bit_length(), limit)


def pack(ends: list[int], ids: list[int], tables: list[list[int]], rows: int, blocks: int, scratch_block: int):
    """The input of a ``(rows, blocks)`` step as one int64 tensor (CPU): token ids ``[rows]``,
    sequence lengths ``[rows]``, block tables ``[rows, blocks]``; the rows past ``len(ends)``
    are padding (token 0, length 1, every block the scratch block), and each table is padded
    with the scratch block."""
    values = torch.full((rows * (2 + blocks),), scratch_block, dtype=torch.long)
    count = len(ends)
    values[:rows] = 0
    values[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    values[rows : 2 * rows] = 1
    values[rows : rows + count] = torch.tensor(ends, dtype=torch.long)
    table_view = values[2 * rows :].view(rows, blocks)
    for row, table in enumerate(tables):
        table_view[row, : len(table)] = torch.tensor(table, dtype=torch.long)
    return values


def unpack(inputs: torch.Tensor, rows: int, blocks: int, block_size: int):
    """(ids, positions, written slots, context slots ``[rows, blocks * block_size]``, mask) of
    a packed input, by tensor arithmetic alone (it runs inside the graph)."""
    ids, lengths = inputs[:rows], inputs[rows : 2 * rows]
    tables = inputs[2 * rows :].view(rows, blocks)
    offsets = torch.arange(block_size, device=inputs.device)
    slots = (tables[:, :, None] * block_size + offsets).flatten(1)
    positions = lengths - 1
    written = slots.gather(1, positions[:, None])[:, 0]
    mask = torch.arange(blocks * block_size, device=inputs.device) < lengths[:, None]
    return ids, positions, written, slots, mask


class DecodeStep:
    """One bucket: its input buffer on the device, its body, and its CUDA graph on a GPU."""

    def __init__(self, decoder, rows: int, blocks: int, *, pool=None):
        self.decoder, self.rows, self.blocks = decoder, rows, blocks
        padding = pack([], [], [], rows, blocks, decoder.scratch_block)  # warm-up and capture touch scratch only
        self.inputs = padding.to(decoder.keys.device)
        self.graph = None
        self.hidden = None
        if self.inputs.is_cuda:
            self._capture(pool)

    def _body(self) -> torch.Tensor:
        return self.decoder.decode_layers(*unpack(self.inputs, self.rows, self.blocks, self.decoder.block_size))

    def _capture(self, pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # the lazy initialisation of the step's kernels happens outside the graph
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's thread captures while other threads (the server's) may use CUDA
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.hidden = self._body()

    def run(self, packed: torch.Tensor) -> torch.Tensor:
        """The hidden states ``[rows, hidden]`` after the step over ``packed`` (a graph's
        output is overwritten by its next replay)."""
        self.inputs.copy_(packed)
        if self.graph is None:
            return self._body()
        self.graph.replay()
        return self.hidden


class DecodeGraphs:
    """A decoder's bucketed decode steps (see [Note: decode graphs across batches])."""

    def __init__(self, decoder, buckets: DecodeBuckets):
        self.decoder, self.buckets = decoder, buckets
        self.device = decoder.keys.device
        self.steps: dict[tuple[int, int], DecodeStep] = {}
        """The buckets used so far, by (rows, blocks)."""
        self.runs: Counter[tuple[int, int]] = Counter()
        """Steps run per bucket."""
        self.replays = 0
        """Steps run by replaying a CUDA graph."""
        self.failed: str | None = None
        """Why a capture failed (then every step runs eagerly), or None."""
        self._pool = None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()

    def fits(self, plan) -> bool:
        """Whether ``plan`` is a step this runs: one token per chunk, within the buckets."""
        size = self.decoder.block_size
        return (
            self.failed is None
            and bool(plan.ends)
            and all(end - start == 1 for start, end in zip(plan.starts, plan.ends))
            and len(plan.ends) <= self.buckets.max_rows
            and -(-max(plan.ends) // size) <= self.buckets.max_blocks
        )

    def run(self, plan) -> torch.Tensor | None:
        """The hidden states ``[chunks, hidden]`` after the decoder layers for a plan that
        ``fits``, through its bucket's step (captured on first use); None when a capture
        failed (then ``failed`` says why, and every later step runs eagerly)."""
        rows = bucket(len(plan.ends), self.buckets.max_rows)
        blocks = bucket(-(-max(plan.ends) // self.decoder.block_size), self.buckets.max_blocks)
        packed = pack(plan.ends, plan.ids, plan.tables, rows, blocks, self.decoder.scratch_block)
        with torch.cuda.device(self.device) if self._pool is not None else nullcontext():
            step = self.steps.get((rows, blocks))
            if step is None:
                try:
                    step = DecodeStep(self.decoder, rows, blocks, pool=self._pool)
                except RuntimeError as error:  # warm-up and capture write the scratch block only
                    self.failed = f"capturing the decode step of {rows} rows and {blocks} blocks failed: {error}"
                    logger.warning("%s; decode steps run eagerly from now on", self.failed)
                    return None
                self.steps[rows, blocks] = step
            hidden = step.run(packed)
        self.runs[rows, blocks] += 1
        self.replays += step.graph is not None
        return hidden[: len(plan.ends)]
