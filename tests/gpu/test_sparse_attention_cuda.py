"""Block-sparse attention on a CUDA GPU goes through the Triton kernel (fp16/bf16, no masks)
or FlexAttention (compiled once) and equals dense attention masked by the expanded layout,
outputs and q/k/v gradients, for DeepSpeed's layouts, with key-padding and attention masks,
in fp32, fp16 and bf16. Skipped without a GPU."""

import warnings

import pytest
import torch

from shardwise.ops.sparse_attention import _block_sparse, _triton_kernel
from shardwise.ops.sparse_attention._block_sparse import block_sparse_attention
from shardwise.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, DIM, SEQ = 4, 32, 512
LAYOUTS = {
    "fixed": lambda block: FixedSparsityConfig(HEADS, block, num_local_blocks=4, num_global_blocks=1),
    "fixed_causal": lambda block: FixedSparsityConfig(
        HEADS, block, num_local_blocks=4, num_global_blocks=1, attention="unidirectional"
    ),
    "variable": lambda block: VariableSparsityConfig(
        HEADS, block, num_random_blocks=1, local_window_blocks=(2, 4), global_block_indices=(0, 5)
    ),
    "bigbird": lambda block: BigBirdSparsityConfig(HEADS, block, different_layout_per_head=True),
    "longformer": lambda block: BSLongformerSparsityConfig(HEADS, block),
}
TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _reference(q, k, v, layout, block, kpm=None, am=None):
    """Dense float64 attention: scale, then additive key padding, then a multiplicative
    attention mask, then the layout."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if kpm is not None:
        scores = scores + kpm.double()[:, None, None, :]
    if am is not None:
        scores = scores.masked_fill(am == 0, float("-inf"))
    allowed = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2).to(q.device)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


CASES = (
    [(name, 64, torch.bfloat16, False) for name in sorted(LAYOUTS)]
    + [(name, 32, torch.float32, False) for name in ("fixed", "longformer")]
    + [
        ("bigbird", 64, torch.float16, False),
        ("fixed", 64, torch.bfloat16, True),
        ("longformer", 32, torch.float32, True),
        ("fixed", 128, torch.bfloat16, True),
    ]
)


@pytest.mark.parametrize(
    ("name", "block", "dtype", "masks"),
    CASES,
    ids=[f"{n}-{b}-{str(d)[6:]}-{'masks' if m else 'plain'}" for n, b, d, m in CASES],
)
@pytest.mark.parametrize("path", ["triton", "flex"])
def test_block_sparse_attention_equals_masked_dense_attention(name, block, dtype, masks, path, monkeypatch):
    if path == "flex":
        monkeypatch.setattr(_triton_kernel, "available", lambda *args: False)
    elif masks or dtype == torch.float32 or _triton_kernel.triton is None:
        pytest.skip("the Triton kernel takes fp16/bf16 without masks")
    layout = LAYOUTS[name](block).make_layout(SEQ)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, HEADS, SEQ, DIM, device="cuda", generator=generator).to(dtype).requires_grad_() for _ in range(3)
    )
    kwargs, ref_masks = {}, {}
    if masks:
        kpm = torch.zeros(2, SEQ, device="cuda")
        kpm[1, -block // 2 :] = -10000.0  # the second sequence's padding
        am = torch.ones(SEQ, SEQ, device="cuda").tril()  # every row keeps its own position
        kwargs = dict(
            key_padding_mask=kpm.to(dtype), key_padding_mask_mode="add", attn_mask=am.to(dtype), attn_mask_mode="mul"
        )
        ref_masks = dict(kpm=kpm.to(dtype), am=am)
    with warnings.catch_warnings():  # a compile failure would warn and fall back to the gather path
        warnings.filterwarnings("error", message="FlexAttention failed")
        out = block_sparse_attention(q, k, v, layout, block, **kwargs)
    assert not _block_sparse._flex_state["failed"]
    ref = _reference(q, k, v, layout, block, **ref_masks)
    grad = torch.randn(out.shape, device="cuda", generator=generator)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name_, g, w in zip("qkv", got, want):
        scale = w.abs().max().item()
        torch.testing.assert_close(
            g.double(), w.double(), atol=tol * max(scale, 1.0), rtol=tol, msg=lambda m, name_=name_: f"d{name_}: {m}"
        )


def test_triton_path_is_taken_for_plain_half_inputs(monkeypatch):
    """Plain bf16 calls run the Triton kernel (neither FlexAttention nor the gather path)
    and agree with FlexAttention on the same inputs."""
    if _triton_kernel.triton is None:
        pytest.skip("Triton is not installed")
    layout = LAYOUTS["bigbird"](64).make_layout(1024)
    q, k, v = (torch.randn(1, HEADS, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    calls = []
    flex = _block_sparse._flex_attention
    monkeypatch.setattr(_block_sparse, "_flex_attention", lambda *a, **kw: calls.append(1) or flex(*a, **kw))
    triton_out = block_sparse_attention(q, k, v, layout, 64)
    assert not calls
    monkeypatch.setattr(_triton_kernel, "available", lambda *args: False)
    flex_out = block_sparse_attention(q, k, v, layout, 64)
    assert calls
    torch.testing.assert_close(triton_out.float(), flex_out.float(), atol=3e-2, rtol=3e-2)


def test_flex_path_is_taken_and_matches_the_gather_path(monkeypatch):
    monkeypatch.setattr(_triton_kernel, "available", lambda *args: False)
    """The CUDA call is the FlexAttention kernel (the gather path is not called) and agrees
    with the gather path run on the same GPU."""
    layout = LAYOUTS["bigbird"](64).make_layout(1024)
    q, k, v = (torch.randn(1, HEADS, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    calls = []
    original = _block_sparse._gather_attention
    _block_sparse._gather_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        flex = block_sparse_attention(q, k, v, layout, 64)
        assert not calls
        _block_sparse._flex_state["failed"] = True  # force the fallback once
        gather = block_sparse_attention(q, k, v, layout, 64)
        assert calls
    finally:
        _block_sparse._flex_state["failed"] = False
        _block_sparse._gather_attention = original
    torch.testing.assert_close(flex.float(), gather.float(), atol=3e-2, rtol=3e-2)
