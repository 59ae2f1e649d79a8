"""One GRPO iteration on a small Llama on 2 ranks (gloo, CPU, one thread per rank), five ways
in one run, alternating:

- ``hybrid``: shardwise's Hybrid Engine under ZeRO-3 (``"hybrid_engine": {"enabled": true}``):
  ``engine.generate`` with each prompt's prefill shared by its group
  (``prepare_shared_prefill``), then the GRPO loss, ``backward`` and ``step``;
- ``hybrid-graph`` (GPU only): ``hybrid`` with ``"enable_cuda_graph": true`` (decode steps
  replayed as CUDA graphs);
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

On a GPU (``--device cuda``: NCCL, rank ``r`` on GPU ``LOCAL_RANK``, clocks read after
``torch.cuda.synchronize()``) the same loop runs the ``hybrid`` and ``zero3`` variants (DeepSpeed
and TRL are not on the GPU image) at a 1B-class size (``--model-size 1b``: Llama hidden 2048,
intermediate 5632, 22 layers, 32 / 4 heads, the same word-level vocabulary, about 0.98B
parameters), in bf16 with ``--dtype bfloat16`` (the model is loaded in fp32; the config's
``"bf16": {"enabled": true}`` makes the engine cast it)::

    python bench/bench_rlhf.py --device cuda --nproc 1 --model-size 1b --dtype bfloat16 \\
        --variants hybrid,zero3 --rounds 1 --steps 3 --timeout 75 --out rlhf.md
"""

from __future__ import annotations

import argparse
import contextlib
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
# (hidden, intermediate, layers, attention heads, key-value heads)
SIZES = {"small": (512, 1376, 4, 8, 4), "1b": (2048, 5632, 22, 32, 4)}
CPU_VARIANTS = "hybrid,hybrid-tp2,zero3,deepspeed3,trl"
CUDA_VARIANTS = "hybrid-graph,hybrid,zero3"


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def _model_config(args):
    import transformers

    hidden, intermediate, layers, heads, kv_heads = SIZES[args.model_size]
    return transformers.LlamaConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=args.layers or layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )


def _save_model(args, path: str) -> int:
    """Build the model (fp32, seed 0; on the GPU when there is one: much faster at 1B), save
    it to ``path`` with the tokenizer; its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda" if args.device == "cuda" else "cpu"):
        model = transformers.LlamaForCausalLM(_model_config(args))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    count = sum(p.numel() for p in model.parameters())
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return count


def polite_reward(completions, **kwargs):
    """The share of each completion's words that are polite."""
    return [sum(w in POLITE for w in c.split()) / max(len(c.split()), 1) for c in completions]


def _prompts(rank: int, step: int) -> list[str]:
    import random

    rng = random.Random(1000 * step + rank)
    return [" ".join(rng.choice(WORDS) for _ in range(PROMPT_LEN)) for _ in range(PROMPTS)]


def _zero3_config(dtype: str = "float32") -> dict:
    config = {
        "train_micro_batch_size_per_gpu": PROMPTS * GENERATIONS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
    }
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    return config


def _clock(cuda: bool) -> float:
    """``time.perf_counter()`` once the GPU's queued work is done."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def _dtypes_seen(dtypes: dict, key: str, record: bool):
    """Record in ``dtypes[key]`` the floating dtypes of every ``nn.Linear`` weight that runs
    inside the block (once, in the warm-up iteration: the check that bf16 is really used)."""
    import torch

    if not record:
        yield
        return
    seen = set()

    def hook(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            seen.add(_dtype_name(module.weight))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        dtypes[key] = ",".join(sorted(seen)) or "no nn.Linear ran"


# -- the GRPO iteration on an engine ----------------------------------------------------------


def _advantages(rewards):
    """Rewards normalised within each group of GENERATIONS samples of one prompt."""
    groups = rewards.view(-1, GENERATIONS)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


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
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    library.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tokenizer = _tokenizer()
    model = transformers.LlamaForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    config = _zero3_config(args.dtype)
    if args.variant.startswith("hybrid"):
        tp = 2 if args.variant == "hybrid-tp2" else 1
        config["hybrid_engine"] = {"enabled": True, "max_out_tokens": PROMPT_LEN + NEW_TOKENS, "inference_tp_size": tp}
        config["hybrid_engine"]["enable_cuda_graph"] = args.variant == "hybrid-graph"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = library.initialize(model=model, optimizer=optimizer, config=config)
    sample = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": NEW_TOKENS}
    sample.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    sample["synced_gpus"] = True  # as DeepSpeed-Chat under ZeRO-3: a rank whose rows all ended keeps gathering
    times, gen_times, tokens, parts, dtypes = [], [], [], [], {}
    for step in range(args.steps + 1):
        torch.distributed.barrier()
        start = _clock(cuda)
        ids = tokenizer(_prompts(rank, step), return_tensors="pt").input_ids.repeat_interleave(GENERATIONS, 0)
        ids = ids.to(device)
        engine.eval()
        if args.variant in ("hybrid", "hybrid-graph"):  # (not yet with an inference tensor group)
            engine.prepare_shared_prefill(PROMPTS, GENERATIONS, PROMPT_LEN)
        with torch.no_grad(), _dtypes_seen(dtypes, "generation weights", step == 0):
            out = engine.module.generate(ids, attention_mask=torch.ones_like(ids), **sample)
        generated = _clock(cuda)
        engine.train()
        out = torch.nn.functional.pad(out, (0, PROMPT_LEN + NEW_TOKENS - out.shape[1]), value=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, PROMPT_LEN:].cpu(), skip_special_tokens=True)
        advantages = _advantages(torch.tensor(polite_reward(texts), device=device))
        with _dtypes_seen(dtypes, "training weights", step == 0):
            loss, active = _grpo_loss(engine, out, advantages, tokenizer.eos_token_id)
        engine.backward(loss)
        engine.step()
        times.append(_clock(cuda) - start)
        gen_times.append(generated - start)
        tokens.append(active / len(texts))
        if args.variant.startswith("hybrid"):  # the fill of the weights' copy, the prompt, the decode steps
            stats, fill = engine.last_generation, engine.inference_view.last_fill_s
            parts.append([fill, stats.time_to_first_token_s, stats.total_s - stats.time_to_first_token_s])
    record = {"times": times, "gen": gen_times, "tokens": tokens, "parts": parts, "dtypes": dtypes}
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
        for rank in range(args.nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(args.nproc),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(args.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            }
            if args.device == "cpu":
                env.update(OMP_NUM_THREADS="1", SHARDWISE_ACCELERATOR="cpu", DS_ACCELERATOR="cpu")
            python = args.ds_python if variant == "deepspeed3" else sys.executable
            cmd = [python, __file__, "--worker", variant, "--steps", str(args.steps)]
            cmd += ["--model-dir", args.model_dir, "--result", str(result)]
            cmd += ["--device", args.device, "--dtype", args.dtype]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + args.timeout
        try:
            outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            for p in procs:
                p.communicate()
            return {"error": f"timed out after {args.timeout:.0f} s (--timeout)"}
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
        "dtypes": rank0.get("dtypes", {}),
    }


def _row(name: str, runs: list[dict], key: str) -> tuple[float, str]:
    values = [r[key] for r in runs if "error" not in r]
    if not values:
        return float("nan"), f"| {name} | failed: {runs[0]['error']} | | |"
    med = median_or_nan(values)
    return med, f"| {name} | {med:.3f} | {min(values):.3f}-{max(values):.3f} |"


def _setup_lines(args, results: dict[str, list[dict]]) -> list[str]:
    """The model, dtype and the dtypes seen at work; none for the default small fp32 model on
    the CPU (that table reads as before)."""
    if (args.device, args.model_size, args.dtype, args.layers) == ("cpu", "small", "float32", None):
        return []
    hidden, intermediate, layers, heads, kv_heads = SIZES[args.model_size]
    lines = [
        f"Model: Llama hidden {hidden}, intermediate {intermediate}, {args.layers or layers} layers, "
        f"{heads} / {kv_heads} heads, vocab {len(WORDS) + 2}, {args.num_params / 1e9:.3f}B parameters, "
        f"loaded in fp32; training dtype {args.dtype}"
        + (' (config `"bf16": {"enabled": true}`).' if args.dtype == "bfloat16" else "."),
    ]
    for variant, runs in results.items():
        seen = next((r["dtypes"] for r in runs if r.get("dtypes")), None)
        if seen:
            lines.append(
                f"{variant}: dtypes of the nn.Linear weights that ran: "
                + "; ".join(f"{k} {v}" for k, v in seen.items())
            )
    return lines


def _device_label(args) -> str:
    import torch

    return torch.cuda.get_device_name() if args.device == "cuda" else "CPU"


def table(args, results: dict[str, list[dict]]) -> str:
    import torch

    ranks = f"{args.nproc} rank" + ("s" if args.nproc != 1 else "")
    machine = f"Machine: {cpu_model()}, {os.cpu_count()} CPUs"
    if args.device == "cuda":
        machine += f", {_device_label(args)} (CUDA {torch.version.cuda})"
    lines = [
        f"# One GRPO iteration, {ranks}, {_device_label(args)} ({date.today().isoformat()})",
        "",
        f"{machine}; torch {torch.__version__}; "
        f"{args.rounds} rounds of {args.steps} iterations after a warm-up, variants alternating.",
        "Command: `python bench/bench_rlhf.py " + " ".join(sys.argv[1:]) + "`",
        *_setup_lines(args, results),
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
        ("generation", "hybrid-graph", "zero3", "hybrid (CUDA graphs) generation / zero3 generation", "<= 0.3x"),
        ("iteration", "hybrid-graph", "zero3", "hybrid (CUDA graphs) iteration / zero3 iteration", ""),
        ("generation", "hybrid-graph", "hybrid", "hybrid with CUDA graphs / without, generation", ""),
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


def _check_args(parser, args) -> None:
    """Refuse what cannot run as asked, naming the fix."""
    import torch

    args.variants = args.variants or (CUDA_VARIANTS if args.device == "cuda" else CPU_VARIANTS)
    variants = args.variants.split(",")
    unknown = set(variants) - set(CPU_VARIANTS.split(",")) - {"hybrid-graph"}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {CPU_VARIANTS}")
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if "hybrid-tp2" in variants and args.nproc < 2:
        parser.error(f"--variants hybrid-tp2 needs 2 ranks (inference_tp_size 2), got --nproc {args.nproc}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False; use --device cpu")
        if args.nproc > torch.cuda.device_count():
            parser.error(f"--nproc {args.nproc} on cuda needs as many GPUs, found {torch.cuda.device_count()}")
        off = [v for v in variants if v in ("deepspeed3", "trl")]
        if off:
            parser.error(f"--variants {','.join(off)}: CPU only here (DeepSpeed's venv and TRL are not on the GPU "
                         f"image); on cuda use --variants {CUDA_VARIANTS}")  # fmt: skip
    if args.dtype == "bfloat16" and "trl" in variants:
        parser.error("--variants trl runs fp32 only (GRPOConfig bf16=False); drop it with --dtype bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=None, help=f"default {CPU_VARIANTS} (cpu), {CUDA_VARIANTS} (cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (on cuda one GPU each)")
    parser.add_argument("--model-size", choices=tuple(SIZES), default="small")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)  # a smoke of the 1b width
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
    _check_args(parser, args)
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = str(Path(tmp) / "llama")
        args.num_params = _save_model(args, args.model_dir)
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
