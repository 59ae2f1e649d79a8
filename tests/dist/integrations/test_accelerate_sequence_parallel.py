"""Accelerate's sequence-parallel route on shardwise: ``ParallelismConfig(sp_backend="deepspeed",
sp_size=2)`` with ``shardwise.install_as_deepspeed()``. ``accelerator.prepare`` registers the
Ulysses attention (``deepspeed.runtime.sequence_parallel.ulysses_sp``), wraps the DataLoader
in the adapter and builds the engine with its mpu; the loss is accelerate's own recipe (the
pieces' losses all-gathered and weighted by their token counts). Per-step losses and final
weights equal single-process SGD on the whole sequences each step trained on."""

import importlib.util
import os

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")

SEQ, STEPS, LR = 16, 4, 0.5


def _llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _job(rank, world_size):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    shardwise.install_as_deepspeed()  # before Accelerate is imported
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs, ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    ids = torch.randint(0, 64, (STEPS, SEQ), generator=torch.Generator().manual_seed(1))  # accelerate shards it
    data = [{"input_ids": row, "position_ids": torch.arange(SEQ), "labels": row} for row in ids]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 2}}  # fmt: skip
    parallelism = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=2,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
    )
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), parallelism_config=parallelism,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])  # fmt: skip
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    from deepspeed.utils import groups

    group = groups._get_sequence_parallel_group()
    unwrapped = accelerator.unwrap_model(engine)
    losses, wholes = [], []
    for batch in loader:
        shift_labels = batch["shift_labels"]
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = unwrapped.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=64)
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=group)
        good = (shift_labels != -100).sum()
        good_per_rank = torch.distributed.nn.functional.all_gather(good, group=group)
        total = sum(lo * g for lo, g in zip(losses_per_rank, good_per_rank) if g > 0) / sum(good_per_rank)
        accelerator.backward(total)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total))
        pieces = [None, None]
        torch.distributed.all_gather_object(pieces, (batch["input_ids"], shift_labels), group=group)
        wholes.append(tuple(torch.cat(parts, dim=1) for parts in zip(*pieces)))
    state = {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    return losses, wholes, state, type(engine).__name__


def test_accelerate_parallelism_config_trains_sequence_parallel(tmp_path):
    results = run_distributed(_job, world_size=2, tmp_path=tmp_path, timeout_s=180, fresh_processes=True)
    losses, wholes, state, engine_type = results[0]
    assert engine_type == "Engine" and len(losses) == STEPS
    reference = _llama()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step, (ids, shift_labels) in enumerate(wholes):
        logits = reference(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
        assert abs(float(loss) - losses[step]) < 1e-5, (step, float(loss), losses[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        assert float((state[name] - value).abs().max()) < 1e-5, name
    assert results[1][0] == losses  # both ranks of the group report the whole sequences' loss
