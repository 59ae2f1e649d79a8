"""The Hugging Face Trainer's sequence-parallel path on shardwise: ``TrainingArguments(deepspeed=...,
parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))`` with
``shardwise.install_as_deepspeed()``. The Trainer builds the engine, the Ulysses attention and the
DataLoader adapter through accelerate, and computes its own loss (the pieces' losses all-gathered
and weighted by their token counts). Its per-step losses and final weights equal single-process
SGD on the whole sequences, in the order the adapter fed them (each rank's batch in turn)."""

import importlib.util
import os

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")

STEPS, LR = 4, 0.5


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _job(rank, world_size, out):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    shardwise.install_as_deepspeed()  # before accelerate and the Trainer import DeepSpeed
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row, "position_ids": torch.arange(16)} for row in ids]
    seen = []

    def collate(rows):
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        seen.append(batch["input_ids"].clone())  # this rank's batches, before the adapter splits them
        return batch

    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": "auto",
                 "zero_optimization": {"stage": 2}}  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=STEPS, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
        deepspeed=ds_config, ddp_backend="gloo", use_cpu=True,
        parallelism_config=ParallelismConfig(
            sp_backend="deepspeed", sp_size=2,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
        ),
    )  # fmt: skip
    trainer = transformers.Trainer(model=_llama(), args=args, train_dataset=data, data_collator=collate)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    state = {
        k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model_wrapped).state_dict().items()
    }
    return losses, seen, state, type(trainer.model_wrapped).__name__


def test_trainer_sequence_parallel_equals_whole_sequence_training(tmp_path):
    results = run_distributed(_job, world_size=2, tmp_path=tmp_path, timeout_s=200, fresh_processes=True,
                              out=str(tmp_path / "out"))  # fmt: skip
    losses, _, state, engine_type = results[0]
    assert engine_type == "Engine" and len(losses) == STEPS and results[1][0] == losses
    reference = _llama()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):  # the adapter trains rank 0's batch, then rank 1's, then rank 0's next...
        ids = results[step % 2][1][step // 2]
        loss = reference(input_ids=ids, labels=ids).loss
        assert abs(float(loss) - losses[step]) < 1e-4, (step, float(loss), losses[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        assert float((state[name] - value).abs().max()) < 1e-5, name
