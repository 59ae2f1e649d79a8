"""The batching engine's bucketed decode steps (CUDA graphs on a GPU, see
[Note: decode graphs across batches]) on a CPU, where a bucket runs its body without a graph:
bucket sizes, the packed input of padded rows, the scratch block no sequence gets, and
greedy requests joining and leaving, so that the batch grows and shrinks across buckets,
equal to ``generate`` (as the eager step's are, ``test_batching_engine.py``)."""

import pytest
import torch

from shardwise.serve._batching import BatchingConfig, BatchingEngine
from shardwise.serve._blocks import BlockAllocator
from shardwise.serve._decode_graphs import DecodeBuckets, bucket, pack, unpack
from shardwise.serve._paged import PagedDecoder
from shardwise.serve._scheduler import Scheduler, Sequence

transformers = pytest.importorskip("transformers")
from serve_models import greedy, tiny_llama  # noqa: E402 - needs transformers

MODEL = tiny_llama()


def test_buckets_are_powers_of_two_capped_at_the_limit():
    assert [bucket(n, 12) for n in range(1, 13)] == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    assert [bucket(n, 16) for n in (1, 3, 5, 9, 16)] == [1, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="no bucket holds 13: buckets hold 1..12"):
        bucket(13, 12)
    with pytest.raises(ValueError, match="max_rows and max_blocks must be positive"):
        DecodeBuckets(max_rows=0, max_blocks=4)


def test_padded_rows_write_and_read_only_the_scratch_block():
    decoder = PagedDecoder(MODEL, num_blocks=6, block_size=4)
    assert decoder.scratch_block == 6 and decoder.keys.shape[1] == 7 * 4  # one block beyond the allocator's
    tables, ends = [[3, 0], [5]], [6, 2]  # two sequences at lengths 6 and 2
    packed = pack(ends, [11, 12], tables, 4, 4, decoder.scratch_block)
    ids, positions, written, slots, mask = unpack(packed, 4, 4, 4)
    assert ids.tolist() == [11, 12, 0, 0] and positions.tolist() == [5, 1, 0, 0]
    for row, (table, end) in enumerate(zip(tables, ends)):  # real rows: the eager step's slots
        assert written[row] == decoder.slots(table, end - 1, end)
        assert slots[row, :end].tolist() == decoder.slots(table, 0, end).tolist() and mask[row].sum() == end
    scratch = set(range(6 * 4, 7 * 4))
    assert set(written[2:].tolist()) == {6 * 4} and mask[2:].sum(-1).tolist() == [1, 1]
    assert set(slots[2:].flatten().tolist()) <= scratch
    for row, table in enumerate(tables):  # a real row's table is padded with the (masked) scratch block
        assert set(slots[row, len(table) * 4 :].tolist()) <= scratch and not mask[row, len(table) * 4 :].any()
    allocator = BlockAllocator(6, 4)
    assert decoder.scratch_block not in [allocator.allocate() for _ in range(6)]  # no sequence ever owns it


def _serve(decoder, arrivals, *, num_blocks):
    """Greedy decoding through the scheduler and ``decoder``, step by step in this thread;
    ``arrivals[step]`` are the (prompt, tokens) requests that join before that step."""
    scheduler = Scheduler(BlockAllocator(num_blocks, 4), max_num_seqs=4, token_budget=64)
    arrivals, outputs, step = dict(arrivals), {}, 0
    while arrivals or not scheduler.idle:
        for prompt, tokens in arrivals.pop(step, []):
            scheduler.add(Sequence(str(len(outputs)), prompt, tokens))
            outputs[str(len(outputs))] = None
        chunks = scheduler.schedule()
        logits = decoder.forward(chunks) if chunks else []
        scheduler.complete(chunks)
        for chunk, row in zip([c for c in chunks if c.samples], logits):
            sequence = chunk.sequence
            sequence.generated.append(int(row.argmax()))
            if len(sequence.generated) == sequence.max_tokens:
                outputs[sequence.request_id] = sequence.generated
                scheduler.release(sequence)
        step += 1
    return list(outputs.values())


def test_requests_joining_and_leaving_across_buckets_equal_generate():
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 5, 14)]
    # one row, then three (two joining at step 2), one leaving and one joining at step 4, then fewer
    arrivals = {0: [(prompts[0], 8)], 2: [(prompts[1], 5), (prompts[2], 2)], 4: [(prompts[3], 2)]}
    bucketed = PagedDecoder(MODEL, num_blocks=24, block_size=4, buckets=DecodeBuckets(max_rows=4, max_blocks=10))
    expected = [greedy(MODEL, p, t) for wave in arrivals.values() for p, t in wave]
    assert _serve(bucketed, arrivals, num_blocks=24) == expected
    rows = sorted({r for r, _ in bucketed.graphs.runs})
    assert rows == [1, 2, 4] and len(bucketed.graphs.runs) >= 4 and bucketed.graphs.replays == 0  # no GPU here
    assert max(bucketed.graphs.runs.values()) > 1  # a bucket's step is kept and run again
    assert BatchingEngine(MODEL, None, max_model_len=40, config=BatchingConfig()).decoder.graphs is None  # CPU: eager


def test_enforce_eager_and_the_old_keywords_reach_the_config():
    from shardwise.serve._cli import build_engine, parser

    args = parser().parse_args(["model", "--enforce-eager"])
    engine = build_engine("batched", MODEL, None, max_model_len=40, max_queue=4, max_num_seqs=2,
                          enforce_eager=args.enforce_eager)  # fmt: skip
    engine.shutdown()
    assert engine.config == BatchingConfig(max_num_seqs=2, enforce_eager=True)
    engine = BatchingEngine(MODEL, None, max_model_len=40, config=BatchingConfig(max_num_seqs=2), block_size=8)
    engine.shutdown()
    assert (engine.config.max_num_seqs, engine.config.block_size, engine.allocator.block_size) == (2, 8, 8)
    with pytest.raises(TypeError, match="BatchingEngine: .*blocksize.*BatchingConfig's fields"):
        BatchingEngine(MODEL, None, blocksize=8)
    with pytest.raises(ValueError, match="token_budget must be positive, got 0"):
        BatchingConfig(token_budget=0)


def test_a_failed_capture_leaves_every_step_eager(monkeypatch):
    from shardwise.serve import _decode_graphs

    def failing(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_decode_graphs, "DecodeStep", failing)
    decoder = PagedDecoder(MODEL, num_blocks=8, block_size=4, buckets=DecodeBuckets(max_rows=4, max_blocks=10))
    prompt = [5, 6, 7]
    assert _serve(decoder, {0: [(prompt, 3)]}, num_blocks=8) == [greedy(MODEL, prompt, 3)]
    assert "capturing the decode step of 1 rows and 1 blocks failed: operation not permitted" in decoder.graphs.failed
    assert not decoder.graphs.runs  # the failed step and the next one ran eagerly
