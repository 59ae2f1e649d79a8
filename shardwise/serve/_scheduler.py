"""Iteration-level scheduling with chunked prefill.

[Note: continuous batching]
Every step the scheduler picks what the model computes next, under a budget of tokens per
forward (``token_budget``):

1. every running sequence whose prompt is in the cache decodes one token (the token it
   generated last), oldest first;
2. the rest of the budget goes to prompts: first the one a previous step left half
   computed, then waiting requests in arrival order while fewer than ``max_num_seqs`` run.
   A prompt longer than what is left is cut into a chunk (SplitFuse): its next piece is
   computed in the next step, fused with everyone's decodes, so a long prompt never stalls
   the others' next token.

A chunk needs cache slots for its tokens; a sequence takes blocks as it reaches them. When
no block is free, a prompt waits (it is not admitted), and a decode preempts the sequence
admitted last: its blocks return to the pool and it goes back to the front of the queue, to
be recomputed from its prompt and the tokens it already generated. Requests join and leave
the batch at every step; the scheduler is pure bookkeeping, tested without a model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardwise.serve._blocks import BlockAllocator, PrefixCache


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens whose keys and values are in the cache."""
    payload: object = None
    """The engine's own state of the request (stream, sampler, clocks)."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without copying the whole sequence."""
        split = len(self.prompt)
        return self.prompt[start : min(end, split)] + self.generated[max(start - split, 0) : max(end - split, 0)]

    @property
    def pending(self) -> int:
        """Tokens not in the cache yet: 1 for a sequence that decodes."""
        return self.length - self.computed


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start..end-1`` of ``sequence`` to compute this step; ``samples`` when ``end``
    is the sequence's length (its next token is drawn from the last position's logits)."""

    sequence: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == self.sequence.length


class Scheduler:
    """See [Note: continuous batching]."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        token_budget: int,
        prefix_cache: PrefixCache | None = None,
    ):
        if token_budget < 1 or max_num_seqs < 1:
            raise ValueError(f"token_budget and max_num_seqs must be positive, got {token_budget}, {max_num_seqs}")
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def schedule(self) -> list[Chunk]:
        """This step's chunks (decodes first, then prompt pieces)."""
        budget = self.token_budget
        chunks = []
        for sequence in list(self.running):
            if budget == 0 or sequence.pending != 1 or sequence not in self.running:
                continue  # out of budget, a prompt in progress (below), or preempted meanwhile
            while not self._reserve(sequence, sequence.computed + 1) and sequence in self.running:
                self._preempt_newest()
            if sequence in self.running:
                chunks.append(Chunk(sequence, sequence.computed, sequence.computed + 1))
                budget -= 1
        for sequence in [s for s in self.running if s.pending > 1]:
            budget = self._prefill(sequence, budget, chunks)
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            sequence = self.waiting[0]
            if self.prefix_cache is not None and not sequence.blocks:  # see [Note: prefix caching]
                sequence.blocks = self.prefix_cache.lookup(sequence.prompt)
                sequence.computed = len(sequence.blocks) * self.allocator.block_size
            if not self._reserve(sequence, min(sequence.length, sequence.computed + budget)):
                break
            self.waiting.popleft()
            self.running.append(sequence)
            budget = self._prefill(sequence, budget, chunks)
        return chunks

    def _prefill(self, sequence: Sequence, budget: int, chunks: list[Chunk]) -> int:
        if budget == 0:
            return 0
        end = min(sequence.length, sequence.computed + budget)
        if not self._reserve(sequence, end):
            return budget
        chunks.append(Chunk(sequence, sequence.computed, end))
        return budget - (end - sequence.computed)

    def _reserve(self, sequence: Sequence, tokens: int) -> bool:
        """Blocks for ``tokens`` slots; False (nothing taken) when too few are free."""
        needed = self.allocator.blocks_for(tokens) - len(sequence.blocks)
        if needed > self.allocator.num_free:
            return False
        sequence.blocks.extend(self.allocator.allocate() for _ in range(max(needed, 0)))
        return True

    def _preempt_newest(self) -> None:
        """Free the blocks of the sequence admitted last; it waits first in line, to be
        recomputed from its prompt and generated tokens."""
        victim = self.running[-1]
        self.preemptions += 1
        self.release(victim)
        victim.computed = 0
        self.waiting.appendleft(victim)

    def complete(self, chunks: list[Chunk]) -> None:
        """The model computed ``chunks``: their tokens are in the cache."""
        for chunk in chunks:
            chunk.sequence.computed = chunk.end
            if self.prefix_cache is not None:
                sequence = chunk.sequence
                self.prefix_cache.insert(sequence.prompt, sequence.blocks, sequence.computed)

    def release(self, sequence: Sequence) -> None:
        """``sequence`` leaves the batch (finished, cancelled or preempted): its blocks return."""
        for block in sequence.blocks:
            self.allocator.free(block)
        sequence.blocks = []
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
