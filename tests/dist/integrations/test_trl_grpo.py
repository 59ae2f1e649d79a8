"""TRL's ``GRPOTrainer`` with a DeepSpeed ZeRO-3 config trains on shardwise through
``shardwise.install_as_deepspeed()`` (2 gloo ranks, a tiny Llama saved to a directory, a
reward function in Python, 2 steps).

What TRL needs of DeepSpeed here: its reference model goes through
``deepspeed.initialize`` without an optimizer, built partitioned by ``zero.Init``, with
section keys written at the top level of its config ("zero_optimization.reduce_bucket_size");
its fused log-prob head reads ``param.ds_status``; around generation it gathers every
parameter and removes DeepSpeed's ZeRO-3 hooks (``optimizer.parameter_offload``,
``ds3_gather_for_generation``, TRL's default). ``stage3_param_persistence_threshold`` is 0
(DeepSpeed's default would keep this tiny model's parameters whole), so every parameter is
partitioned, ``lm_head.weight`` too: TRL's fused log-prob head multiplies by it without
calling ``lm_head`` (in the forward and again in the backward), which works because, as in
DeepSpeed, a sharded parameter read during a forward is gathered ([Note: reading a sharded
parameter]).
"""

import importlib.util
import math
import os

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")  # in the test extra (it brings datasets, pandas and pyarrow)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")

WORDS = [f"w{i}" for i in range(60)]
POLITE = set(WORDS[:12])


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def polite_reward(completions, **kwargs):
    """The share of a completion's words that are polite."""
    return [sum(w in POLITE for w in c.split()) / max(len(c.split()), 1) for c in completions]


def _save_tiny_llama(path, tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _grpo_job(rank, world_size, out):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    shardwise.install_as_deepspeed()  # before transformers' Trainer, Accelerate and TRL import deepspeed
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    # Accelerate picks no backend for DeepSpeed on a machine without accelerators: gloo
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    tokenizer, path = _tokenizer(), os.path.join(out, "tiny-llama")
    initial = _save_tiny_llama(path, tokenizer) if rank == 0 else None
    torch.distributed.barrier()
    generator = torch.Generator().manual_seed(0)
    prompts = [" ".join(WORDS[int(i)] for i in torch.randint(0, 60, (6,), generator=generator)) for _ in range(16)]
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    args = GRPOConfig(
        output_dir=os.path.join(out, "grpo"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.04,
        logging_steps=1,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        bf16=False,
        deepspeed=config,
        accelerator_config={"use_configured_state": True},
    )
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=polite_reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
    )
    trainer.train()
    engine, ref = trainer.model_wrapped, trainer.ref_model
    checks = {
        "engines": [isinstance(e, shardwise.DeepSpeedEngine) and e.zero_optimization_stage() for e in (engine, ref)],
        "head": [e.module.lm_head.weight.ds_status.name for e in (engine, ref)],
        "ref_laid_out": all(hasattr(p, "ds_status") for p in ref.module.parameters()) and ref.optimizer is None,
        "log": [(h["loss"], h["reward"]) for h in trainer.state.log_history if "loss" in h],
    }
    state = engine.module_state_dict()
    if rank == 0:
        checks["changed"] = max((state[k] - v).abs().max().item() for k, v in initial.items())
    return checks


def test_grpo_trainer_with_zero3_config_trains(tmp_path):
    results = run_distributed(
        _grpo_job, world_size=2, tmp_path=tmp_path, timeout_s=240, fresh_processes=True, out=str(tmp_path)
    )
    for checks in results:
        assert checks["engines"] == [3, 3], checks["engines"]
        assert checks["head"] == ["NOT_AVAILABLE"] * 2, "threshold 0: lm_head.weight is partitioned between steps"
        assert checks["ref_laid_out"], "the reference model (zero.Init, no optimizer) is laid out in units"
        assert len(checks["log"]) == 2 and all(math.isfinite(x) for step in checks["log"] for x in step)
    assert results[0]["changed"] > 1e-3, "two GRPO steps at lr 1e-2 move the policy's weights"
