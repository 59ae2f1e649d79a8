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
        self.evict = None
        """Called for a block when none is free (a ``PrefixCache`` sets it); returns False if
        nothing can be given back."""
        self.cache: PrefixCache | None = None
        self._cached: set[int] = set()
        self._evictable = 0
        """Cached blocks (see ``PrefixCache``) that only the cache holds, kept as holders change."""

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: free ones and those only a prefix cache keeps."""
        return len(self._free) + self._evictable

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by sequences (blocks only a prefix cache keeps are free)."""
        return 1.0 - self.num_free / self.num_blocks

    def holders(self, block: int) -> int:
        return self._holders[block]

    def allocate(self) -> int:
        if not self._free and not (self.evict is not None and self.evict()):
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        block = self._free.popleft()
        self._holders[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of an allocated ``block``."""
        if self._holders[block] == 0:
            raise ValueError(f"block {block} is free; only an allocated block can be shared")
        if block in self._cached and self._holders[block] == 1:
            self._evictable -= 1
        self._holders[block] += 1

    def free(self, block: int) -> None:
        """One holder less; the block returns to the free list with its last holder."""
        if self._holders[block] == 0:
            raise ValueError(f"block {block} is freed twice (it is already free)")
        self._holders[block] -= 1
        if block in self._cached and self._holders[block] <= 1:  # the cache alone holds it, or gave it back
            self._evictable += 1 if self._holders[block] == 1 else -1
        if self._holders[block] == 0:
            self._cached.discard(block)
            self._free.append(block)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` token slots."""
        return -(-tokens // self.block_size)


class PrefixCache:
    """Blocks of prompt tokens kept for reuse by later prompts that start the same way.

    [Note: prefix caching]
    A block full of prompt tokens whose keys and values are computed is registered under the
    hash of its tokens and of every token before it (the chain of blocks up to it), so only
    a prompt with the same whole prefix finds it. A new prompt takes, in order, every block
    of its prefix found here (sharing it, see ``BlockAllocator.share``) and computes only the
    rest; at least its last token is always computed, since its logits are needed (that
    token's slot may be written again with the same values). The cache itself holds one share
    of each block it keeps; blocks nobody else holds are *evictable*: they count as free in
    the usage metric and the least recently used is given back when the allocator runs out.
    """

    def __init__(self, allocator: BlockAllocator):
        from collections import OrderedDict

        self.allocator = allocator
        self._blocks: OrderedDict[int, int] = OrderedDict()  # chain hash -> block
        allocator.evict, allocator.cache = self.evict_one, self
        self.hits = 0
        """Prompt tokens taken from the cache instead of computed."""

    @staticmethod
    def _chain(tokens: list[int], block_size: int, count: int) -> list[int]:
        hashes, parent = [], 0
        for i in range(count):
            parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
            hashes.append(parent)
        return hashes

    def lookup(self, prompt: list[int]) -> list[int]:
        """Shared blocks of the longest cached prefix of ``prompt`` (leaving its last token)."""
        size = self.allocator.block_size
        blocks = []
        for chain in self._chain(prompt, size, (len(prompt) - 1) // size):
            block = self._blocks.get(chain)
            if block is None:
                break
            self._blocks.move_to_end(chain)
            self.allocator.share(block)
            blocks.append(block)
        self.hits += len(blocks) * size
        return blocks

    def insert(self, prompt: list[int], blocks: list[int], computed: int) -> None:
        """Register the full prompt blocks among the first ``computed`` tokens."""
        size = self.allocator.block_size
        full = min(computed, len(prompt)) // size
        for chain, block in zip(self._chain(prompt, size, full), blocks):
            if chain not in self._blocks:
                self._blocks[chain] = block
                self.allocator.share(block)
                self.allocator._cached.add(block)

    def evict_one(self) -> bool:
        """Give back the least recently used block only the cache holds; False if none."""
        for chain, block in self._blocks.items():
            if self.allocator.holders(block) == 1:
                del self._blocks[chain]
                self.allocator.free(block)
                return True
        return False

    @property
    def evictable(self) -> int:
        return self.allocator._evictable
