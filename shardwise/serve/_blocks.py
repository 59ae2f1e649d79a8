"""The paged KV cache's bookkeeping: fixed-size blocks of token slots, handed out as sequences
grow and returned when they end.

[Note: paged KV cache]
The cache of every layer is one pool of ``num_blocks * block_size`` token slots. A sequence
owns a list of blocks (its block table); the key and value of its token at position ``p``
live in slot ``table[p // block_size] * block_size + p % block_size``. Blocks are allocated
one at a time as a sequence reaches a new block and all return to the free list when it
finishes, is cancelled or is preempted, so memory follows the tokens actually held, not
``max_model_len`` per request. Reference counts let blocks be shared (a freed block with
other holders stays allocated); freeing a block nobody holds is an error, never a silent
double entry in the free list.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """No free block is left."""


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` (see [Note: paged KV cache])."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._holders = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        block = self._free.popleft()
        self._holders[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of an allocated ``block``."""
        if self._holders[block] == 0:
            raise ValueError(f"block {block} is free; only an allocated block can be shared")
        self._holders[block] += 1

    def free(self, block: int) -> None:
        """One holder less; the block returns to the free list with its last holder."""
        if self._holders[block] == 0:
            raise ValueError(f"block {block} is freed twice (it is already free)")
        self._holders[block] -= 1
        if self._holders[block] == 0:
            self._free.append(block)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` token slots."""
        return -(-tokens // self.block_size)
