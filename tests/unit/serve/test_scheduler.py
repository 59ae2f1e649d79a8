"""The paged KV cache's block allocator and the continuous-batching scheduler, without a model:
blocks handed out and returned exactly once, decodes before prompt chunks under the token
budget, prompts cut into chunks at the budget, the running batch bounded, and preemption of
the newest sequence when blocks run out."""

import pytest

from shardwise.serve._blocks import BlockAllocator, OutOfBlocks
from shardwise.serve._scheduler import Scheduler, Sequence


def test_blocks_are_handed_out_and_returned_once():
    allocator = BlockAllocator(3, 4)
    blocks = [allocator.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and allocator.usage == 1.0
    with pytest.raises(OutOfBlocks):
        allocator.allocate()
    allocator.share(blocks[0])
    allocator.free(blocks[0])
    assert allocator.num_free == 0  # still held by its second holder
    allocator.free(blocks[0])
    assert allocator.num_free == 1
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free(blocks[0])
    assert allocator.num_free == 1 and allocator.blocks_for(9) == 3


def _sequence(name, prompt_len, generated=()):
    return Sequence(name, list(range(prompt_len)), 100, generated=list(generated))


def _spans(chunks):
    return [(c.sequence.request_id, c.start, c.end, c.samples) for c in chunks]


def test_a_long_prompt_is_cut_at_the_budget_and_decodes_go_first():
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=4, token_budget=4)
    long = _sequence("long", 10)
    scheduler.add(long)
    assert _spans(scheduler.schedule()) == [("long", 0, 4, False)]
    long.computed = 4
    short = _sequence("short", 2)
    scheduler.add(short)
    assert _spans(scheduler.schedule()) == [("long", 4, 8, False)]  # the budget is used up by the long prompt
    long.computed = 8
    assert _spans(scheduler.schedule()) == [("long", 8, 10, True), ("short", 0, 2, True)]
    long.computed, short.computed = 10, 2
    long.generated.append(7)
    short.generated.append(9)
    assert _spans(scheduler.schedule()) == [("long", 10, 11, True), ("short", 2, 3, True)]  # one decode each


def test_the_running_batch_is_bounded_and_release_returns_every_block():
    allocator = BlockAllocator(64, 4)
    scheduler = Scheduler(allocator, max_num_seqs=2, token_budget=100)
    sequences = [_sequence(f"s{i}", 5) for i in range(3)]
    for s in sequences:
        scheduler.add(s)
    assert [c.sequence.request_id for c in scheduler.schedule()] == ["s0", "s1"]
    assert [s.request_id for s in scheduler.waiting] == ["s2"]
    for s in sequences:
        scheduler.release(s)
    assert allocator.num_free == 64 and scheduler.idle


def test_out_of_blocks_preempts_the_newest_sequence():
    allocator = BlockAllocator(4, 2)  # 8 slots
    scheduler = Scheduler(allocator, max_num_seqs=4, token_budget=100)
    old, new = _sequence("old", 4), _sequence("new", 4)
    scheduler.add(old)
    scheduler.add(new)
    scheduler.complete(scheduler.schedule())  # both prompts: all 4 blocks
    old.generated.append(1)
    new.generated.append(2)
    chunks = scheduler.schedule()  # old needs a fifth block: new is preempted
    assert _spans(chunks) == [("old", 4, 5, True)]
    assert scheduler.preemptions == 1 and [s.request_id for s in scheduler.waiting] == ["new"]
    assert new.computed == 0 and new.blocks == [] and len(old.blocks) == 3
    scheduler.complete(chunks)
    scheduler.release(old)
    assert _spans(scheduler.schedule()) == [("new", 0, 5, True)]  # prompt and its token, recomputed


def test_the_prefix_cache_shares_whole_prefixes_only_and_gives_back_what_nobody_holds():
    from shardwise.serve._blocks import PrefixCache

    allocator = BlockAllocator(8, 2)
    cache = PrefixCache(allocator)
    first = [allocator.allocate() for _ in range(3)]
    prompt = [1, 2, 3, 4, 5, 6, 7]
    cache.insert(prompt, first, computed=7)  # 3 full blocks
    assert [allocator.holders(b) for b in first] == [2, 2, 2]
    assert cache.lookup([1, 2, 3, 4, 9, 9, 9]) == first[:2]  # the first two blocks match
    assert cache.lookup([1, 2, 3, 4, 5, 6]) == first[:2]  # its last token stays to compute
    assert cache.lookup([3, 4, 5]) == []  # block [3, 4] is cached only after [1, 2]
    for block in first[:2] * 2 + first:  # the two lookups' shares, then the first sequence's
        allocator.free(block)
    assert allocator.usage == 0.0 and cache.evictable == 3  # kept, but counted free
    taken = [allocator.allocate() for _ in range(8)]  # 5 free, then the 3 cached are given back
    assert sorted(taken) == list(range(8)) and cache.evictable == 0
    with pytest.raises(OutOfBlocks):
        allocator.allocate()
