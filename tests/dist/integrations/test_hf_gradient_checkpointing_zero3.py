"""Hugging Face gradient checkpointing (``model.gradient_checkpointing_enable()``, i.e.
torch.utils.checkpoint around each decoder layer) under ZeRO stage 3: the recompute in
backward gathers the partitioned parameters again, and training matches stage 0 without
checkpointing. Both of torch's checkpoint forms, and DeepSpeed's ``checkpointing.checkpoint``
as the layers' checkpoint function, are checked in one spawn."""

import warnings

import pytest
import torch

import shardwise
from shardwise import checkpointing
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL
from shardwise.zero import GatheredParameters

transformers = pytest.importorskip("transformers")

MICRO, STEPS, LR = 2, 3, 0.05


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def _train(rank, stage, checkpoint_kwargs):
    model = _model()
    if checkpoint_kwargs == "deepspeed":
        # Megatron-style: each layer through deepspeed.checkpointing.checkpoint (reentrant, ours)
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpointing.checkpoint)
        model.enable_input_require_grads()
        model.config.use_cache = False
    elif checkpoint_kwargs is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it; the old name is the test
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    model.train()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, **(STAGE3_PARTITION_ALL if stage == 3 else {})},
        },
    )
    generator = torch.Generator().manual_seed(1 + rank)  # per-rank data
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (MICRO, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return losses, params


def _check_gradient_checkpointing_under_stage3(rank, world_size):
    reference_losses, reference = _train(rank, 0, None)
    report = {}
    for name, kwargs in (
        ("non-reentrant", {"use_reentrant": False}),
        ("reentrant", {"use_reentrant": True}),
        ("deepspeed.checkpointing", "deepspeed"),
    ):
        losses, params = _train(rank, 3, kwargs)
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        report[name] = (losses == pytest.approx(reference_losses, rel=1e-5), diff)
    return report


def test_hf_gradient_checkpointing_under_stage3_matches_stage0(tmp_path):
    for rank, report in enumerate(
        run_distributed(_check_gradient_checkpointing_under_stage3, world_size=2, tmp_path=tmp_path)
    ):
        for name, (losses_match, diff) in report.items():
            assert losses_match, f"rank {rank}, {name}: losses differ from stage 0"
            assert diff < 1e-5, f"rank {rank}, {name}: parameters differ from stage 0 by {diff}"  # fp32
