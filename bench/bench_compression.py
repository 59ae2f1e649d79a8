"""Compression on the demo GPT: held-out perplexity of ZeroQuant and XTC, and int8 generation time.

One process trains the demo GPT (``examples/gpt_model.py``, byte-level Python sources as in
``examples/train_gpt.py``) for ``--steps`` steps, then measures on held-out blocks (the last
``--eval-blocks`` windows of the corpus, never trained on):

- ``fp32``: the trained model;
- ``W8A8``: ZeroQuant PTQ (``shardwise.compression.zeroquant``): 8-bit weights in groups of
  ``--group-size`` input columns, 8-bit token-wise dynamic activations, no distillation;
- ``W4A8`` and ``W4A8+LKD``: 4-bit weights, without and with layer-by-layer distillation on
  ``--calib`` training batches;
- ``XTC``: a student with half the blocks (teacher blocks 1, 3, ...) and ternary weights,
  trained ``--xtc-steps`` steps with knowledge distillation from the fp32 model; its size
  is counted at 2 bits per quantized weight plus one float32 scale per group.

Then greedy generation (``--new-tokens`` tokens after a ``--prompt``-token prompt, the full
context recomputed every token: the demo GPT has no KV cache) is timed three ways, one
generation of each by turns per round, the first variant alternating: the fp32 model through
``init_inference``, the W8A8 model through ``init_inference(dtype=torch.int8)`` (torchao's
int8 kernels), and the fp32 model quantized by torchao's own
``Int8DynamicActivationInt8WeightConfig`` on the same layers::

    OMP_NUM_THREADS=1 python bench/bench_compression.py --out bench/results/<date>-cpu-compression.md
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import re
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from _machine import cpu_model  # this folder is on sys.path when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardwise  # noqa: E402
from examples.gpt_model import GPT, ByteBlocks, GPTConfig, byte_corpus  # noqa: E402
from shardwise.compression import init_compression, zeroquant  # noqa: E402

LINEARS = r"blocks\.\d+\.(qkv|proj|fc|out)$"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=300, help="fp32 training steps")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-blocks", type=int, default=96)
    p.add_argument("--group-size", type=int, default=64, help="input columns per weight quantization group")
    p.add_argument("--calib", type=int, default=8, help="calibration batches for LKD")
    p.add_argument("--lkd-steps", type=int, default=100)
    p.add_argument("--lkd-lr", type=float, default=1e-4)
    p.add_argument("--xtc-steps", type=int, default=150)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=str, default=None)
    return p.parse_args()


def zeroquant_config(weight_bits: int, group_size: int) -> dict:
    """ZeroQuant's W{bits}A8 as a ``compression_training`` section (see
    ``examples/configs/compression_zeroquant.json``)."""
    shared = {"enabled": True, "quantize_weight_in_forward": True, "quantize_group_size": group_size}
    params = {"start_bits": weight_bits, "target_bits": weight_bits}
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {**shared, "schedule_offset": 0},
                "different_groups": {"wq": {"params": params, "modules": [LINEARS]}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "range_calibration": "dynamic", "schedule_offset": 0},
                "different_groups": {"aq": {"params": {"bits": 8}, "modules": [LINEARS]}},
            },
        }
    }


def xtc_config(layers: int, group_size: int) -> dict:
    teacher_layers = list(range(1, layers, 2))
    return {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": len(teacher_layers),
                "module_name_prefix": "blocks",
                "teacher_layer": teacher_layers,
                "other_module_name": ["tok_emb", "pos_emb", "ln_f", "head"],
            },
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": True,
                    "quantize_group_size": group_size,
                    "schedule_offset": 0,
                },
                "different_groups": {"ternary": {"params": {"start_bits": 2, "target_bits": 2}, "modules": [LINEARS]}},
            },
        }
    }


def batches(data: ByteBlocks, indices: list[int], batch: int):
    for start in range(0, len(indices) - batch + 1, batch):
        xs, ys = zip(*(data[i] for i in indices[start : start + batch]))
        yield torch.stack(xs), torch.stack(ys)


@torch.no_grad()
def perplexity(model, data, indices, batch) -> float:
    model.eval()
    losses = [model(x, y).item() for x, y in batches(data, indices, batch)]
    return math.exp(statistics.fmean(losses))


def train(model, data, indices, args, *, steps, lr, teacher=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        pick = torch.randint(0, len(indices), (args.batch,), generator=gen).tolist()
        x, y = next(batches(data, [indices[i] for i in pick], args.batch))
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if teacher is not None:
            with torch.no_grad():
                soft = F.softmax(teacher(x), dim=-1)
            loss = loss + F.kl_div(F.log_softmax(logits, dim=-1), soft, reduction="batchmean") / x.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step + 1) / steps))


def size_bits(model, bits_of: dict[str, int], group_size: int) -> int:
    """Bits to store ``model``: quantized linear weights at their bits plus a float32 scale
    per group, everything else at 32 bits."""
    total = 0
    for name, p in model.named_parameters():
        layer = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and layer in bits_of:
            total += p.numel() * bits_of[layer] + 32 * p.numel() // group_size
        else:
            total += 32 * p.numel()
    return total


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    idx = prompt
    for _ in range(new_tokens):
        nxt = model(idx)[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def torchao_model(model):
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantized = copy.deepcopy(model)
    names = {n for n, _ in quantized.named_modules() if re.search(LINEARS, n)}
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig(), filter_fn=lambda m, fqn: fqn in names)
    return quantized


def time_generation(variants: dict, prompt, args) -> dict[str, list[float]]:
    times = {name: [] for name in variants}
    names = list(variants)
    for name in names:  # warm up
        generate(variants[name], prompt, 2)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            generate(variants[name], prompt, args.new_tokens)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = ByteBlocks(byte_corpus(max_bytes=2_000_000), seq_len=args.seq)
    train_idx = list(range(len(data) - args.eval_blocks))
    eval_idx = list(range(len(data) - args.eval_blocks, len(data)))
    cfg = GPTConfig(256, args.width, args.layers, args.heads, args.seq, tie_weights=False)
    model = GPT(cfg)
    t0 = time.perf_counter()
    train(model, data, train_idx, args, steps=args.steps, lr=2e-3)
    model.eval()
    rows = {"fp32": (perplexity(model, data, eval_idx, args.batch), 32.0)}
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f}s; fp32 ppl {rows['fp32'][0]:.3f}", flush=True)
    calib = [x for x, _ in batches(data, train_idx[: args.calib * 8], 8)]
    quantized = {}
    for label, bits, lkd in (("W8A8", 8, False), ("W4A8", 4, False), ("W4A8+LKD", 4, True)):
        student = copy.deepcopy(model)
        errors = zeroquant(
            student,
            zeroquant_config(bits, args.group_size),
            calibration=calib if lkd else None,
            lkd_steps=args.lkd_steps,
            lkd_lr=args.lkd_lr,
        )
        quantized[label] = student
        rows[label] = (perplexity(student, data, eval_idx, args.batch), bits)
        lkd_note = "; ".join(f"{e.name} {e.before:.2e}->{e.after:.2e}" for e in errors)
        print(f"{label}: ppl {rows[label][0]:.3f} {lkd_note}", flush=True)
    student = GPT(GPTConfig(256, args.width, args.layers // 2, args.heads, args.seq, tie_weights=False))
    init_compression(student, xtc_config(args.layers, args.group_size), teacher_model=model)
    train(student, data, train_idx, args, steps=args.xtc_steps, lr=5e-4, teacher=model)
    student.eval()
    rows["XTC"] = (perplexity(student, data, eval_idx, args.batch), 2)
    bits_of = {n: 2 for n, _ in student.named_modules() if re.search(LINEARS, n)}
    xtc_ratio = size_bits(model, {}, args.group_size) / size_bits(student, bits_of, args.group_size)
    teacher_linears = sum(32 * m.weight.numel() for n, m in model.named_modules() if re.search(LINEARS, n))
    student_linears = sum(
        2 * m.weight.numel() + 32 * m.weight.numel() // args.group_size
        for n, m in student.named_modules()
        if n in bits_of
    )
    linear_ratio = teacher_linears / student_linears
    print(f"XTC: ppl {rows['XTC'][0]:.3f}, whole model {xtc_ratio:.1f}x smaller", flush=True)

    prompt = data[eval_idx[0]][0][: args.prompt].unsqueeze(0)
    fp32_engine = shardwise.init_inference(copy.deepcopy(model), dtype=torch.float32)
    int8_engine = shardwise.init_inference(copy.deepcopy(quantized["W8A8"]), dtype=torch.int8)
    variants = {"fp32": fp32_engine, "shardwise W8A8": int8_engine, "torchao int8 dynamic": torchao_model(model)}
    same = torch.equal(
        generate(int8_engine, prompt, args.new_tokens), generate(quantized["W8A8"], prompt, args.new_tokens)
    )
    times = time_generation(variants, prompt, args)
    report(args, rows, xtc_ratio, linear_ratio, times, same)


def report(args, rows, xtc_ratio, linear_ratio, times, same) -> None:
    base = rows["fp32"][0]
    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()
    lines = [
        f"# Compression on the demo GPT ({date.today()}, CPU)",
        "",
        f"Machine: {cpu_model()}, 1 thread; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.",
        f"Command: `OMP_NUM_THREADS=1 python bench/bench_compression.py {' '.join(sys.argv[1:])}`",
        f"Model: width {args.width}, {args.layers} blocks, {args.heads} heads, sequence {args.seq}, vocab 256 "
        f"(bytes), trained {args.steps} steps; held-out: the last {args.eval_blocks} windows of the corpus.",
        "",
        "| model | weight bits | held-out perplexity | vs fp32 |",
        "| --- | --- | --- | --- |",
    ]
    for label, (ppl, bits) in rows.items():
        lines.append(f"| {label} | {bits:g} | {ppl:.3f} | {ppl / base:.4f}x |")
    lines += [
        "",
        f"XTC: {args.layers // 2} of {args.layers} blocks, ternary weights in groups of {args.group_size}, "
        f"{args.xtc_steps} distillation steps: the whole model is {xtc_ratio:.1f}x smaller than fp32 "
        f"(embeddings and head stay fp32), the block linear layers {linear_ratio:.1f}x.",
        "",
        f"Greedy generation, {args.prompt}-token prompt + {args.new_tokens} tokens, batch 1, "
        f"{args.rounds} alternating rounds (seconds per generation):",
        "",
        "| variant | median | min-max | vs fp32 | vs torchao |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, values in times.items():
        lines.append(
            f"| {name} | {med[name]:.3f} | {min(values):.3f}-{max(values):.3f} | {med[name] / med['fp32']:.2f}x | "
            f"{med[name] / med['torchao int8 dynamic']:.2f}x |"
        )
    lines += ["", f"W8A8 through init_inference generates the same tokens as the fake-quantized model: {same}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
