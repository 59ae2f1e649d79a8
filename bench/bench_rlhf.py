"""One GRPO iteration on a small Llama on 2 ranks (gloo, CPU, one thread per rank), five ways
in one run, alternating:

- ``hybrid``: shardwise's Hybrid Engine under ZeRO-3 (``"hybrid_engine": {"enabled": true}``):
  ``engine.generate`` with each prompt's prefill shared by its group
  (``prepare_shared_prefill``), then the GRPO loss, ``backward`` and ``step``;
- ``zero3``: the same loop on a ZeRO-3 engine without the Hybrid Engine, generating through
  ``engine.module.generate`` (Hugging Face ``generate``, whose forward gathers every layer
  for every token);
- ``deepspeed3``: the ``zero3`` loop on DeepSpeed 0.19.8's ZeRO-3 engine (``--ds-python``; its
  Hybrid Engine does not run on CPU);
- ``trl``: TRL's ``GRPOTrainer`` (1.16, on shardwise through ``install_as_deepspeed``) with
  the same model, ZeRO-3 config, batch, sampling and loss; TRL gathers the whole model once
  per generation (``ds3_gather_for_generation``, its default) and generates with the model's
  ``generate``.

The workload: a Llama of hidden 512, 4 layers, 8 / 4 heads, intermediate 1376, vocab 4096
(about 16M parameters, fp32, built from a config with ``torch.manual_seed(0)`` and saved to a
directory every variant loads); a word-level tokenizer (one token per word); per rank 4
prompts of 16 tokens with 4 samples each (``num_generations`` 4: 16 completions a rank, 32
in all), at most 32 new tokens, temperature 1, no top-k / top-p; the reward is the share of a
completion's words in a small "polite" vocabulary; advantages are normalised within each
group; the loss is TRL's default ("dapo": clipped ratio times advantage, summed over the
completion tokens up to the end-of-sequence token, divided by the active tokens of the
global batch), ``beta`` 0 (no reference model, TRL's default); AdamW, lr 1e-6. DeepSpeed's
default ``stage3_param_persistence_threshold`` (1e5) partitions every matrix of this model.

Each variant runs ``--steps`` iterations after one warm-up iteration; the table gives the
median over rounds of each round's median iteration and generation time (rank 0's clock; the
ranks step together), their spread, and the ratios the issue's goals name::

    python bench/bench_rlhf.py --out bench/results/<date>-cpu-rlhf.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from _machine import cpu_model, median_or_nan

REPO = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(4094)]
POLITE = set(WORDS[:400])
PROMPTS, GENERATIONS, PROMPT_LEN, NEW_TOKENS = 4, 4, 16, 32


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def _save_model(path: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    _tokenizer().save_pretrained(path)


def polite_reward(completions, **kwargs):
    """The share of each completion's words that are polite."""
    return [sum(w in POLITE for w in c.split()) / max(len(c.split()), 1) for c in completions]


def _prompts(rank: int, step: int) -> list[str]:
    import random

    rng = random.Random(1000 * step + rank)
    return [" ".join(rng.choice(WORDS) for _ in range(PROMPT_LEN)) for _ in range(PROMPTS)]


def _zero3_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": PROMPTS * GENERATIONS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
    }


# -- the GRPO iteration on an engine ----------------------------------------------------------


def _advantages(rewards):
    """Rewards normalised within each group of GENERATIONS samples of one prompt."""
    groups = rewards.view(-1, GENERATIONS)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)


def _grpo_loss(engine, sequences, advantages, eos_id: int):
    """TRL's default loss ("dapo", one iteration per generation, so the ratio is 1 with its
    gradient): the clipped surrogate summed over the active completion tokens, divided by the
    active tokens of the global batch (the engine averages over ranks, hence ``* world``)."""
    import torch
    import torch.distributed as dist

    completion = sequences[:, PROMPT_LEN:]
    ended = (completion == eos_id).int().cumsum(1)
    mask = ((ended == 0) | ((ended == 1) & (completion == eos_id))).float()
    logits = engine(input_ids=sequences, attention_mask=torch.ones_like(sequences)).logits
    logps = torch.log_softmax(logits[:, PROMPT_LEN - 1 : -1].float(), dim=-1)
    logps = logps.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logps - logps.detach())
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    active = mask.sum()
    total = active.clone()
    dist.all_reduce(total)
    return (per_token * mask).sum() / total * dist.get_world_size(), active.item()


def _engine_worker(args, result: Path) -> None:
    """The loop on shardwise's engine (``hybrid``, ``hybrid-tp2``, ``zero3``) or DeepSpeed's
    (``deepspeed3``: its ZeRO-3 engine's ``module.generate``; its Hybrid Engine does not run
    on CPU)."""
    import torch
    import transformers

    library = __import__("deepspeed" if args.variant == "deepspeed3" else "shardwise")
    torch.set_num_threads(1)
    library.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    tokenizer = _tokenizer()
    model = transformers.LlamaForCausalLM.from_pretrained(args.model_dir)
    config = _zero3_config()
    if args.variant.startswith("hybrid"):
        tp = 2 if args.variant == "hybrid-tp2" else 1
        config["hybrid_engine"] = {"enabled": True, "max_out_tokens": PROMPT_LEN + NEW_TOKENS, "inference_tp_size": tp}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = library.initialize(model=model, optimizer=optimizer, config=config)
    sample = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": NEW_TOKENS}
    sample.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    sample["synced_gpus"] = True  # as DeepSpeed-Chat under ZeRO-3: a rank whose rows all ended keeps gathering
    times, gen_times, tokens, parts = [], [], [], []
    for step in range(args.steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        ids = tokenizer(_prompts(rank, step), return_tensors="pt").input_ids.repeat_interleave(GENERATIONS, 0)
        engine.eval()
        if args.variant == "hybrid":  # (not yet with an inference tensor group)
            engine.prepare_shared_prefill(PROMPTS, GENERATIONS, PROMPT_LEN)
        with torch.no_grad():
            out = engine.module.generate(ids, attention_mask=torch.ones_like(ids), **sample)
        generated = time.perf_counter()
        engine.train()
        out = torch.nn.functional.pad(out, (0, PROMPT_LEN + NEW_TOKENS - out.shape[1]), value=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, PROMPT_LEN:], skip_special_tokens=True)
        advantages = _advantages(torch.tensor(polite_reward(texts)))
        loss, active = _grpo_loss(engine, out, advantages, tokenizer.eos_token_id)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        gen_times.append(generated - start)
        tokens.append(active / len(texts))
        if args.variant.startswith("hybrid"):  # the fill of the weights' copy, the prompt, the decode steps
            stats, fill = engine.last_generation, engine.inference_view.last_fill_s
            parts.append([fill, stats.time_to_first_token_s, stats.total_s - stats.time_to_first_token_s])
    record = {"times": times, "gen": gen_times, "tokens": tokens, "parts": parts}
    result.with_suffix(f".rank{rank}.json").write_text(json.dumps(record))


# -- the same iteration in TRL's GRPOTrainer ------------------------------------------------


def _trl_worker(args, result: Path) -> None:
    import torch

    import shardwise

    torch.set_num_threads(1)
    shardwise.install_as_deepspeed()  # before transformers' Trainer, Accelerate and TRL import deepspeed
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # Accelerate picks no backend for DeepSpeed without accelerators
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    prompts = [p for step in range(args.steps + 1) for r in range(world) for p in _prompts(r, step)]
    times, gen_times, tokens = [], [], []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.distributed.barrier()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    config = {**_zero3_config(), "gradient_clipping": "auto"}
    config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", train_batch_size="auto")
    trainer = GRPOTrainer(
        model=args.model_dir,
        reward_funcs=polite_reward,
        args=GRPOConfig(
            output_dir=str(result.parent / "trl"),
            per_device_train_batch_size=PROMPTS * GENERATIONS,
            num_generations=GENERATIONS,
            max_completion_length=NEW_TOKENS,
            max_steps=args.steps + 1,
            learning_rate=1e-6,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_grad_norm=0.0,
            bf16=False,
            report_to=[],
            seed=0,
            disable_tqdm=True,
            save_strategy="no",
            logging_steps=1,
            shuffle_dataset=False,
            deepspeed=config,
            accelerator_config={"use_configured_state": True},
        ),
        processing_class=_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[StepClock()],
    )
    generate_turn = trainer._generate_single_turn

    def timed_generate(*a, **k):
        start = time.perf_counter()
        out = generate_turn(*a, **k)
        gen_times.append(time.perf_counter() - start)
        return out

    trainer._generate_single_turn = timed_generate
    trainer.train()
    tokens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    result.with_suffix(f".rank{rank}.json").write_text(json.dumps({"times": times, "gen": gen_times, "tokens": tokens}))


# -- the driver -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(args, variant: str) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "SHARDWISE_ACCELERATOR": "cpu",
                "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            }
            python = args.ds_python if variant == "deepspeed3" else sys.executable
            cmd = [python, __file__, "--worker", variant, "--steps", str(args.steps)]
            cmd += ["--model-dir", args.model_dir, "--result", str(result)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        if any(p.returncode for p in procs):
            failed = next(o for p, o in zip(procs, outputs) if p.returncode)
            print(failed[-3000:], file=sys.stderr)
            lines = [ln for ln in failed.strip().splitlines() if ln.strip()]
            return {"error": lines[-1][:200] if lines else "failed"}
        rank0 = json.loads(result.with_suffix(".rank0.json").read_text())
    return {
        "iteration": statistics.median(rank0["times"][1:]),
        "generation": statistics.median(rank0["gen"][1:]),
        "tokens": statistics.mean(rank0["tokens"][1:]),
        "parts": [statistics.median(p) for p in zip(*rank0.get("parts", [])[1:])],
    }


def _row(name: str, runs: list[dict], key: str) -> tuple[float, str]:
    values = [r[key] for r in runs if "error" not in r]
    if not values:
        return float("nan"), f"| {name} | failed: {runs[0]['error']} | | |"
    med = median_or_nan(values)
    return med, f"| {name} | {med:.3f} | {min(values):.3f}-{max(values):.3f} |"


def table(args, results: dict[str, list[dict]]) -> str:
    import torch

    lines = [
        f"# One GRPO iteration, 2 ranks, CPU ({date.today().isoformat()})",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"{args.rounds} rounds of {args.steps} iterations after a warm-up, variants alternating.",
        "Command: `python bench/bench_rlhf.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| variant | median s | spread (round medians) | completion tokens |",
        "|---|---|---|---|",
    ]
    medians = {}
    for kind in ("iteration", "generation"):
        for variant, runs in results.items():
            med, row = _row(f"{variant} {kind}", runs, kind)
            tokens = median_or_nan(r["tokens"] for r in runs if "error" not in r)
            lines.append(f"{row} {tokens:.1f} |")
            medians[(variant, kind)] = med
    lines += ["", "| ratio | value | goal |", "|---|---|---|"]
    ratios = [
        ("generation", "hybrid", "zero3", "hybrid generation / zero3 `engine.module.generate`", "<= 0.3x"),
        ("generation", "hybrid-tp2", "zero3", "hybrid (inference_tp_size 2) generation / zero3 generation", "<= 0.3x"),
        ("generation", "hybrid", "deepspeed3", "hybrid generation / DeepSpeed ZeRO-3 `engine.module.generate`", ""),
        ("iteration", "hybrid-tp2", "trl", "hybrid (inference_tp_size 2) iteration / TRL GRPO iteration", "<= 0.5x"),
        ("iteration", "hybrid", "trl", "hybrid iteration / TRL GRPO iteration", "<= 0.5x"),
        ("generation", "hybrid", "trl", "hybrid generation / TRL generation", ""),
        ("iteration", "zero3", "deepspeed3", "zero3 iteration / DeepSpeed ZeRO-3 iteration (baseline health)", ""),
    ]
    for kind, a, b, label, goal in ratios:
        if (a, kind) in medians and (b, kind) in medians:
            lines.append(f"| {label} | {medians[(a, kind)] / medians[(b, kind)]:.3f}x | {goal} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="hybrid,hybrid-tp2,zero3,deepspeed3,trl")
    parser.add_argument("--ds-python", default="/work/ds-env/bin/python", help="DeepSpeed's venv, for deepspeed3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed iterations per run (after one warm-up)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.variant = args.worker
        (_trl_worker if args.worker == "trl" else _engine_worker)(args, args.result)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = str(Path(tmp) / "llama")
        _save_model(args.model_dir)
        results: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
        for round_ in range(args.rounds):
            for variant in results:
                results[variant].append(run_variant(args, variant))
                print(f"round {round_} {variant}: {results[variant][-1]}", flush=True)
    text = table(args, results)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
