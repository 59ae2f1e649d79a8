"""CUDA checks of sparse attention and inference, on a lent GPU, in one process.

``sparse``: block-sparse attention (FlexAttention path) against torch's dense SDPA (flash)
on bf16 ``[1, 16, seq, 64]``, forward alone and forward plus backward, medians of
``--repeats`` after a warm-up; the first call's time (compilation included) is reported
apart, so a layout that recompiles shows.

``inference``: greedy decoding of a 1B-class Llama (TinyLlama-1.1B's shape, random weights,
bf16) with prompt 32 and 128 new tokens, batch 1 and 8: the plain model's ``generate``
against ``shardwise.init_inference`` without and with ``replace_with_kernel_inject``, the
latter with its decode steps eager and as CUDA graphs (the default on a GPU). Time
to first token (the plain model's: a ``max_new_tokens=1`` call), tokens/s, total seconds,
and the fraction of the plain model's greedy tokens each engine reproduces (bf16 kernels
differ, so ties can flip).

    python bench/bench_cuda.py --out bench/results/<date>-<gpu>-cuda.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, repeats: int) -> tuple[float, float]:
    """(first call's seconds, median seconds of ``repeats`` later calls)."""
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    first = time.perf_counter() - start
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def _sparse_on(path: str, kernel_module, attention):
    """``attention`` run on the Triton kernel, or on FlexAttention with the kernel held off."""
    if path == "triton":
        if kernel_module.triton is None:
            raise SystemExit("the triton rows need Triton installed")
        return attention

    def flex(*args):
        available, kernel_module.available = kernel_module.available, lambda *a: False
        try:
            return attention(*args)
        finally:
            kernel_module.available = available

    return flex


def sparse(args) -> list[str]:
    import torch.nn.functional as F

    from shardwise.ops.sparse_attention import _block_sparse, _triton_kernel
    from shardwise.ops.sparse_attention._block_sparse import block_sparse_attention
    from shardwise.ops.sparse_attention.sparsity_config import (
        BigBirdSparsityConfig,
        BSLongformerSparsityConfig,
        FixedSparsityConfig,
    )

    heads, dim, block = 16, 64, 64
    layouts = {
        "longformer": BSLongformerSparsityConfig(heads, block),
        "fixed": FixedSparsityConfig(heads, block, num_local_blocks=4, num_global_blocks=1),
        "bigbird": BigBirdSparsityConfig(heads, block),
    }
    lines = [
        "## Block-sparse attention (Triton kernel, FlexAttention) against dense SDPA, bf16 forward + backward",
        "",
        f"`[1, {heads}, seq, {dim}]`, block {block}; ms are medians of {args.repeats} calls after a warm-up.",
        "",
        "| seq | variant | first call s | forward ms | forward + backward ms | vs dense | density | peak MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for seq in [int(s) for s in args.lengths.split(",")]:
        q, k, v = (
            torch.randn(1, heads, seq, dim, device=args.device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(1, heads, seq, dim, device=args.device, dtype=torch.bfloat16)
        variants = {"dense": (lambda: F.scaled_dot_product_attention(q, k, v), 1.0)}
        for name, config in layouts.items():
            layout = config.make_layout(seq)
            for path in ("triton", "flex"):
                variants[f"{name} {path}"] = (
                    (
                        lambda layout=layout, path=path: _sparse_on(path, _triton_kernel, block_sparse_attention)(
                            q, k, v, layout, block
                        )
                    ),
                    layout.float().mean().item(),
                )
        dense_ms = None
        for name, (forward, density) in variants.items():

            def step(forward=forward):
                torch.autograd.grad(forward(), (q, k, v), grad)
                assert not _block_sparse._flex_state["failed"]  # not the gather fallback

            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            first, median = _time(step, args.repeats)
            peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else 0.0

            def forward_only(forward=forward):
                with torch.no_grad():
                    forward()

            _, forward_s = _time(forward_only, args.repeats)
            dense_ms = dense_ms or median * 1e3
            lines.append(
                f"| {seq} | {name} | {first:.1f} | {forward_s * 1e3:.2f} | {median * 1e3:.2f} | "
                f"{median * 1e3 / dense_ms:.3f}x | {density:.3f} | {peak:.0f} |"
            )
            print(lines[-1], flush=True)
    return lines


def _llama(args):
    import transformers

    size = (
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
        if args.tiny
        else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22)
    )
    config = transformers.LlamaConfig(
        **size,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        initializer_range=0.05,  # logits far enough apart that bf16 rarely flips one
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # every row decodes all new tokens
    return model


def inference(args) -> list[str]:
    import shardwise

    model = _llama(args)
    params = sum(p.numel() for p in model.parameters())
    engines = {
        "hf generate": model,
        "shardwise": shardwise.init_inference(copy.deepcopy(model), dtype=torch.bfloat16),
        "shardwise inject, no graph": shardwise.init_inference(
            copy.deepcopy(model), dtype=torch.bfloat16, replace_with_kernel_inject=True, enable_cuda_graph=False
        ),
        "shardwise inject": shardwise.init_inference(
            copy.deepcopy(model), dtype=torch.bfloat16, replace_with_kernel_inject=True
        ),
    }
    lines = [
        f"## Greedy decoding, Llama {params / 1e9:.2f}B (TinyLlama shape, random weights), bf16",
        "",
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats} runs after a warm-up.",
        "",
        "| batch | engine | TTFT ms | tokens/s | total s | vs hf | tokens equal to hf |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(3, 32000, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(args.device)
        kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        reference = None
        hf_total = None
        for name, engine in engines.items():
            out = engine.generate(ids, **kwargs)
            _, total = _time(lambda: engine.generate(ids, **kwargs), args.repeats)
            if name == "hf generate":
                reference = out
                _, ttft = _time(lambda: engine.generate(ids, **{**kwargs, "max_new_tokens": 1}), args.repeats)
            else:
                assert engine.fast_path == ("inject" in name)
                assert engine.cuda_graph == (name == "shardwise inject" and args.device == "cuda")
                ttft = engine.last_generation.time_to_first_token_s
            hf_total = hf_total or total
            same = (out[:, args.prompt_len :] == reference[:, args.prompt_len :]).float().mean().item()
            lines.append(
                f"| {batch} | {name} | {ttft * 1e3:.1f} | {batch * args.new_tokens / total:.0f} | "
                f"{total:.2f} | {total / hf_total:.3f}x | {same:.3f} |"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="sparse,inference")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a smoke run of the script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    head = [
        "# CUDA checks: sparse attention and inference",
        "",
        f"{date.today()} | {device} | torch {torch.__version__} | `bench/bench_cuda.py --sections {args.sections}`",
        "",
    ]
    body = []
    for section in args.sections.split(","):
        body += {"sparse": sparse, "inference": inference}[section](args) + [""]
    report = "\n".join(head + body)
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
