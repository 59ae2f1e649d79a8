"""Hugging Face transformers models (built from configs, no downloads) train under ZeRO-3."""

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL
from shardwise.zero import GatheredParameters

transformers = pytest.importorskip("transformers")

MICRO, STEPS, LR = 2, 3, 1e-3


def _model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
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


def _batches(world_size):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (MICRO * world_size, 16), generator=generator) for _ in range(STEPS)]


def _build(rank, kind, build, saved):
    """The model to train: plain, or built partitioned by zero.Init (from_pretrained from a
    local save, or from a config and then loaded with zero.load_state_dict)."""
    if build == "plain":
        return _model(kind)
    if build == "init+from_pretrained":
        cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
        with shardwise.zero.Init():
            return cls.from_pretrained(saved)
    with shardwise.zero.Init():
        model = _model(kind)
    shardwise.zero.load_state_dict(model, _model(kind).state_dict() if rank == 0 else None)
    return model


def _train(rank, world_size, kind, build="plain", saved=None):
    model = _build(rank, kind, build, saved)
    partitioned = all(p.numel() == 0 for p in model.parameters())
    reference = _model(kind)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    reference_losses = []
    for ids in _batches(world_size):
        loss = reference(input_ids=ids, labels=ids).loss
        reference_losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
        },
    )
    losses = []
    for ids in _batches(world_size):
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(engine.comm.all_reduce_scalars([loss.item()])[0] / world_size)
    with GatheredParameters(list(engine.module.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), engine.module.parameters()))
        generated = engine.module.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    return reference_losses, losses, diff, generated.shape[1], partitioned


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_model_trains_under_stage3(tmp_path, kind):
    for reference_losses, losses, diff, length, _ in run_distributed(
        _train, world_size=2, tmp_path=tmp_path, kind=kind
    ):
        # the mean of per-rank losses equals the loss on the global batch (equal token counts)
        assert losses == pytest.approx(reference_losses, rel=1e-4)
        assert diff < 2e-5
        assert length == 7  # generate() works with gathered parameters


@pytest.mark.parametrize("kind,build", [("llama", "init+from_pretrained"), ("gpt2", "init+load_state_dict")])
def test_transformers_model_built_partitioned_trains_like_plain(tmp_path, kind, build):
    saved = tmp_path / "pretrained"
    _model(kind).save_pretrained(saved)
    for reference_losses, losses, diff, length, partitioned in run_distributed(
        _train, world_size=2, tmp_path=tmp_path, kind=kind, build=build, saved=str(saved)
    ):
        assert partitioned  # no rank holds a full parameter after zero.Init
        assert losses == pytest.approx(reference_losses, rel=1e-4)
        assert diff < 2e-5
        assert length == 7
