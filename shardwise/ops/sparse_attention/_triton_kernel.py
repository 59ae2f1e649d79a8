"""Block-sparse flash attention in Triton, one kernel tile per layout block.

[Note: the Triton block-sparse kernel]
FlexAttention's sparse tile is 128 tokens, so a 64-token layout turns most touched tiles
into partial ones computed whole and masked token by token: on an H200 the path was 2.1x
dense flash attention at 4k tokens (longformer) and 4.4x at 16k (``fixed``). Here the tile
IS the layout block (16 to 128 tokens), so the work is exactly the layout's nonzero blocks
and no element mask is needed (the layout is the only mask on this path: inside a block
every query sees every key, as DeepSpeed's kernels compute it).

The layout ``[heads, n, n]`` becomes two compressed-row tables, cached with the plan:
``rows`` lists each (head, query block)'s key blocks and ``cols`` each (head, key block)'s
query blocks. Three kernels, each program owning one output tile (no atomics):

- forward, per query block: the online softmax over its key blocks (scores in base 2,
  fp32 accumulators), writing the output and each row's log-sum-exp;
- backward ``dK, dV``, per key block: over its query blocks, recompute the probabilities
  from the log-sum-exp, ``dV += P^T dO``, ``dK += (P * (dO V^T - delta))^T Q``;
- backward ``dQ``, per query block: over its key blocks, ``dQ += (P * (dO V^T - delta)) K``,
  with ``delta = rowsum(dO * O)`` computed once by PyTorch.

Used on CUDA for fp16 and bf16 without masks or ``rpe`` when Triton imports (see
``block_sparse_attention``); tested against dense attention on the GPU, and under
``TRITON_INTERPRET=1`` on a CPU where Triton is installed.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # shardwise works without Triton; this path is then unused
    triton = None

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def available(query: Tensor, block: int) -> bool:
    """Whether the kernel can run these inputs: Triton, a CUDA tensor (or the interpreter)
    in fp16/bf16, power-of-two block and head size of at least 16."""
    if triton is None or query.dtype not in SUPPORTED_DTYPES:
        return False
    dim = query.shape[-1]
    return all(v >= 16 and v & (v - 1) == 0 for v in (block, dim)) and block <= 128 and dim <= 256


def csr(layout: Tensor) -> tuple[Tensor, Tensor]:
    """``(offsets [heads * n + 1], blocks [nnz])``: the nonzero columns of each (head, row)
    of ``layout`` in order, as int32."""
    nonzero = layout.bool()
    counts = nonzero.sum(-1).reshape(-1)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=layout.device)
    offsets[1:] = counts.cumsum(0)
    return offsets, nonzero.nonzero()[:, 2].to(torch.int32)


if triton is not None:

    @triton.jit
    def _forward(
        Q, K, V, OUT, LSE, offsets, blocks, scale_log2, heads, seq, n,
        BLOCK: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        row, bh = tl.program_id(0), tl.program_id(1)
        base = bh.to(tl.int64) * seq * DIM
        tokens = row * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, DIM)
        q = tl.load(Q + base + tokens[:, None] * DIM + dims[None, :])
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, DIM], tl.float32)
        table = (bh % heads) * n + row
        for i in range(tl.load(offsets + table), tl.load(offsets + table + 1)):
            keys = tl.load(blocks + i) * BLOCK + tl.arange(0, BLOCK)
            k = tl.load(K + base + keys[:, None] * DIM + dims[None, :])
            v = tl.load(V + base + keys[:, None] * DIM + dims[None, :])
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            new_best = tl.maximum(best, tl.max(scores, 1))
            shrink = tl.exp2(best - new_best)
            p = tl.exp2(scores - new_best[:, None])
            total = total * shrink + tl.sum(p, 1)
            acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v)
            best = new_best
        tl.store(OUT + base + tokens[:, None] * DIM + dims[None, :], (acc / total[:, None]).to(OUT.dtype.element_ty))
        tl.store(LSE + bh.to(tl.int64) * seq + tokens, best + tl.log2(total))

    @triton.jit
    def _backward_kv(
        Q, K, V, DO, LSE, DELTA, DK, DV, offsets, blocks, scale_log2, scale, heads, seq, n,
        BLOCK: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        col, bh = tl.program_id(0), tl.program_id(1)
        base = bh.to(tl.int64) * seq * DIM
        stats = bh.to(tl.int64) * seq
        keys = col * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, DIM)
        k = tl.load(K + base + keys[:, None] * DIM + dims[None, :])
        v = tl.load(V + base + keys[:, None] * DIM + dims[None, :])
        dk = tl.zeros([BLOCK, DIM], tl.float32)
        dv = tl.zeros([BLOCK, DIM], tl.float32)
        table = (bh % heads) * n + col
        for i in range(tl.load(offsets + table), tl.load(offsets + table + 1)):
            tokens = tl.load(blocks + i) * BLOCK + tl.arange(0, BLOCK)
            q = tl.load(Q + base + tokens[:, None] * DIM + dims[None, :])
            do = tl.load(DO + base + tokens[:, None] * DIM + dims[None, :])
            lse = tl.load(LSE + stats + tokens)
            delta = tl.load(DELTA + stats + tokens)
            p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(DK + base + keys[:, None] * DIM + dims[None, :], (dk * scale).to(DK.dtype.element_ty))
        tl.store(DV + base + keys[:, None] * DIM + dims[None, :], dv.to(DV.dtype.element_ty))

    @triton.jit
    def _backward_q(
        Q, K, V, DO, LSE, DELTA, DQ, offsets, blocks, scale_log2, scale, heads, seq, n,
        BLOCK: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        row, bh = tl.program_id(0), tl.program_id(1)
        base = bh.to(tl.int64) * seq * DIM
        tokens = row * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, DIM)
        q = tl.load(Q + base + tokens[:, None] * DIM + dims[None, :])
        do = tl.load(DO + base + tokens[:, None] * DIM + dims[None, :])
        lse = tl.load(LSE + bh.to(tl.int64) * seq + tokens)
        delta = tl.load(DELTA + bh.to(tl.int64) * seq + tokens)
        dq = tl.zeros([BLOCK, DIM], tl.float32)
        table = (bh % heads) * n + row
        for i in range(tl.load(offsets + table), tl.load(offsets + table + 1)):
            keys = tl.load(blocks + i) * BLOCK + tl.arange(0, BLOCK)
            k = tl.load(K + base + keys[:, None] * DIM + dims[None, :])
            v = tl.load(V + base + keys[:, None] * DIM + dims[None, :])
            p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + base + tokens[:, None] * DIM + dims[None, :], (dq * scale).to(DQ.dtype.element_ty))


class TritonBlockSparse(torch.autograd.Function):
    """``block_sparse_attention`` without masks on the Triton kernels (see
    [Note: the Triton block-sparse kernel]); ``tables`` = ``(rows, cols)``, each ``csr(...)``."""

    @staticmethod
    def forward(ctx, query, key, value, tables, block: int, scale: float | None):
        query, key, value = (t.contiguous() for t in (query, key, value))
        batch, heads, seq, dim = query.shape
        scale = dim**-0.5 if scale is None else scale
        out = torch.empty_like(query)
        lse = torch.empty(batch, heads, seq, dtype=torch.float32, device=query.device)
        n = seq // block
        grid = (n, batch * heads)
        _forward[grid](query, key, value, out, lse, *tables[0], scale * LOG2E, heads, seq, n, BLOCK=block, DIM=dim)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.tables, ctx.block, ctx.scale = tables, block, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        batch, heads, seq, dim = query.shape
        block, scale = ctx.block, ctx.scale
        n = seq // block
        delta = (grad.float() * out.float()).sum(-1)
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        grid = (n, batch * heads)
        common = dict(BLOCK=block, DIM=dim)
        rows, cols = ctx.tables
        _backward_kv[grid](
            query, key, value, grad, lse, delta, dk, dv, *cols, scale * LOG2E, scale, heads, seq, n, **common
        )
        _backward_q[grid](query, key, value, grad, lse, delta, dq, *rows, scale * LOG2E, scale, heads, seq, n, **common)
        return dq, dk, dv, None, None, None


def tables(layout: Tensor, device: torch.device) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The forward's and the backward's compressed-row tables of ``layout`` on ``device``."""
    layout = layout.detach().to(device)
    return csr(layout), csr(layout.transpose(1, 2))
