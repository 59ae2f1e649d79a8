"""DeepSpeed-Ulysses ``DistributedAttention`` on 2 and 4 gloo ranks: each rank holds a piece
of the sequence, and the outputs and the query/key/value gradients of its piece equal those
of ``scaled_dot_product_attention`` over the whole sequence on one rank: causal and not,
grouped-query attention (also with fewer key/value heads than ranks), head counts that do not
divide the ranks, a length that does not divide them, both layouts, rotary embeddings and a
local attention that merges heads. Each rank's local attention sees the whole sequence and
only its share of the heads."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.testing import run_distributed

B, D = 2, 8


def _sdpa(q, k, v, causal):
    """Batch-first ``[b, s, h, d]`` attention, key/value heads repeated for grouped queries."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def _rope(seq, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]  # [1, s, 1, d]


def _case(rank, world_size, q_heads, kv_heads, seq, causal, batch_dim, rope, merged, batch=B):
    from shardwise.sequence.layer import DistributedAttention, apply_rotary_pos_emb

    B = batch  # noqa: N806 - micro-batch 1 takes the exchange's copy-free path
    torch.manual_seed(0)
    q = torch.randn(B, seq, q_heads, D, dtype=torch.float64)
    k, v = (torch.randn(B, seq, kv_heads, D, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(B, seq, q_heads, D, dtype=torch.float64)
    freqs = _rope(seq, D) if rope else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    qr, kr = full[0], full[1]
    if rope:  # the reference applies it to the whole sequence
        qr, kr = (apply_rotary_pos_emb(t, *freqs) for t in (qr, kr))
    reference = _sdpa(qr, kr, full[2], causal)
    reference.backward(grad)

    sizes = [seq // world_size + (r < seq % world_size) for r in range(world_size)]
    start = sum(sizes[:rank])
    piece = slice(start, start + sizes[rank])
    mine = [t[:, piece].clone().requires_grad_() for t in (q, k, v)]
    seen = []

    def local(q_, k_, v_):
        if batch_dim == 1:
            q_, k_, v_ = (t.transpose(0, 1) for t in (q_, k_, v_))
        seen.append((tuple(q_.shape), tuple(k_.shape)))
        out = _sdpa(q_, k_, v_, causal)
        out = out.transpose(0, 1) if batch_dim == 1 else out
        return out.flatten(2) if merged else out

    attention = DistributedAttention(local, None)
    inputs = [t.transpose(0, 1) if batch_dim == 1 else t for t in mine]
    rotary = None
    if rope:  # DeepSpeed permutes (cos, sin) by (1, 0, 2, 3) onto the caller's layout: [s, 1, 1, d] for batch-first
        rotary = tuple(f.permute(1, 0, 2, 3) for f in freqs) if batch_dim == 0 else freqs
    out = attention(*inputs, batch_dim, rotary)
    if batch_dim == 1:
        out = out.transpose(0, 1)
    out = out.reshape(B, sizes[rank], q_heads, D)
    out.backward(grad[:, piece])
    errors = [float((out - reference[:, piece]).abs().max())]
    errors += [float((m.grad - f.grad[:, piece]).abs().max()) for m, f in zip(mine, full)]
    return max(errors), seen[0]


CASES_2 = {
    "mha": dict(q_heads=4, kv_heads=4, seq=12, causal=False),
    "mha-causal": dict(q_heads=4, kv_heads=4, seq=12, causal=True),
    "uneven-heads": dict(q_heads=5, kv_heads=5, seq=12, causal=True, batch=1),
    "gqa": dict(q_heads=8, kv_heads=2, seq=12, causal=True),
    "mqa-replicated": dict(q_heads=4, kv_heads=1, seq=12, causal=True, batch=1),
    "indivisible-length": dict(q_heads=4, kv_heads=2, seq=13, causal=True, batch=1),
}


@pytest.mark.parametrize("name", sorted(CASES_2))
def test_two_ranks_equal_whole_sequence_attention(tmp_path, name):
    case = dict(CASES_2[name], batch_dim=0, rope=False, merged=False)
    for rank, (error, seen) in enumerate(run_distributed(_case, world_size=2, tmp_path=tmp_path, **case)):
        assert error < 1e-10, (name, rank, error)
        q_seen, k_seen = seen
        assert q_seen[1] == case["seq"]  # the local attention sees every position...
        q_split = [case["q_heads"] // 2 + (r < case["q_heads"] % 2) for r in range(2)]
        assert (
            q_seen[2] == q_split[rank] if case["kv_heads"] >= 2 else q_seen[2] == case["q_heads"] // 2
        )  # ...of its heads
        assert k_seen[2] == max(1, case["kv_heads"] // 2 + (rank < case["kv_heads"] % 2))


@pytest.mark.parametrize(
    "options",
    [
        dict(batch_dim=1, rope=False, merged=False),
        dict(batch_dim=0, rope=True, merged=True),
        dict(batch_dim=1, rope=True, merged=False),
    ],
    ids=["seq-first", "rotary-merged", "seq-first-rotary"],
)
def test_layouts_rotary_and_merged_heads(tmp_path, options):
    case = dict(q_heads=4, kv_heads=2, seq=10, causal=True, **options)
    for error, _ in run_distributed(_case, world_size=2, tmp_path=tmp_path, **case):
        assert error < 1e-10, (options, error)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "seq"),
    [(8, 2, 16), (6, 6, 15), (4, 1, 16), (8, 8, 19)],
    ids=["gqa-replicated", "uneven-heads", "mqa", "indivisible-length"],
)
def test_four_ranks_equal_whole_sequence_attention(tmp_path, q_heads, kv_heads, seq):
    case = dict(q_heads=q_heads, kv_heads=kv_heads, seq=seq, causal=True, batch_dim=0, rope=False, merged=False)
    results = run_distributed(_case, world_size=4, tmp_path=tmp_path, **case)
    for rank, (error, (q_seen, _)) in enumerate(results):
        assert error < 1e-10, (rank, error)
        assert q_seen[1] == seq
    assert sum(q_seen[2] for _, (q_seen, _) in results) == q_heads  # every query head on exactly one rank


def _bad_input(rank, world_size):
    from shardwise.sequence.layer import DistributedAttention

    messages = []
    try:
        DistributedAttention(_sdpa, None, scatter_idx=1)
    except ValueError as error:
        messages.append(str(error))
    attention = DistributedAttention(lambda q, k, v: _sdpa(q, k, v, True), None, num_kv_heads=4)
    q, kv = torch.zeros(1, 4, 4, D), torch.zeros(1, 4, 2, D)
    for args in ((q, kv, kv, 2), (q, kv, torch.zeros(1, 4, 1, D), 0), (q, kv, kv, 0)):
        try:
            attention(*args)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_input_is_refused_with_the_reason(tmp_path):
    for messages in run_distributed(_bad_input, world_size=2, tmp_path=tmp_path):
        assert len(messages) == 4, messages
        assert "scatter_idx=1" in messages[0]
        assert "batch_dim_idx must be 0" in messages[1]
        assert "key and value must have one shape" in messages[2]
        assert "num_kv_heads=4 but key has 2 heads" in messages[3]
