"""A model with block-sparse attention trains under ZeRO-2 on 2 and 4 ranks as single-process
PyTorch trains it on the same global batches (plain SGD and AdamW), with its layout taken
from the config's ``sparse_attention`` section; a layout with random blocks drawn
differently on each rank is made rank 0's (by the engine's buffer broadcast, and without an
engine by the first forward)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.ops.sparse_attention import SparseSelfAttention, sparsity_config_from_dict
from shardwise.testing import run_distributed
from shardwise.testing.parity import engine_train, max_param_diff, reference_run

VOCAB, WIDTH, HEADS, SEQ, MICRO, STEPS = 32, 16, 2, 64, 2, 3
SECTION = {
    "mode": "bigbird",
    "block": 8,
    "num_random_blocks": 2,
    "num_sliding_window_blocks": 1,
    "num_global_blocks": 1,
    "different_layout_per_head": True,
}


class SparseLM(nn.Module):
    """Embedding, one block-sparse self-attention layer, a vocabulary head; returns the loss."""

    def __init__(self, layout_seed: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # a key bias gets no gradient (see below)
        self.head = nn.Linear(WIDTH, VOCAB)
        torch.manual_seed(layout_seed)  # the random blocks
        self.attention = SparseSelfAttention(sparsity_config_from_dict(SECTION, HEADS), max_seq_length=SEQ)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        q, k, v = (t.view(*t.shape[:2], HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = self.attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return F.cross_entropy(self.head(x + y).flatten(0, 1), targets.flatten())


def _batches(world_size):
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, VOCAB, (MICRO * world_size, SEQ), generator=generator),
            torch.randint(0, VOCAB, (MICRO * world_size, SEQ), generator=generator),
        )
        for _ in range(STEPS)
    ]


def _first_forward_syncs(rank):
    """Without an engine (which broadcasts buffers at initialize), the first forward makes a
    randomly drawn layout rank 0's."""
    torch.manual_seed(100 + rank)
    attention = SparseSelfAttention(sparsity_config_from_dict(SECTION, HEADS), max_seq_length=SEQ)
    drawn = attention.master_layout.clone()
    q = torch.randn(1, HEADS, SEQ, 4)
    attention(q, q, q)
    torch.manual_seed(100)
    return not torch.equal(drawn, attention.master_layout), torch.equal(
        attention.master_layout,
        SparseSelfAttention(sparsity_config_from_dict(SECTION, HEADS), max_seq_length=SEQ).master_layout,
    )


def _train(rank, world_size):
    report = {"first_forward_syncs": _first_forward_syncs(rank)}
    for name, optimizer, params in (
        ("sgd", torch.optim.SGD, {"lr": 0.5}),
        ("adamw", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.0}),
    ):
        batches = _batches(world_size)
        reference = reference_run(SparseLM(layout_seed=100), batches, lr=params["lr"], clip=0.0, optimizer=optimizer)
        model = SparseLM(layout_seed=100 + rank)  # each rank draws its own random blocks
        drawn = model.attention.master_layout.clone()
        config = {
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": name.replace("adamw", "AdamW").replace("sgd", "SGD"), "params": params},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 500},
            "sparse_attention": SECTION,
        }
        engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
        layout = engine.module.attention.master_layout
        report[name] = {
            "diff": max_param_diff(reference.model, engine.module),
            "movement": reference.movement(),
            "update_error": reference.update_error(engine.module),
            "drawn_differs": not torch.equal(drawn, reference.model.attention.master_layout),
            "layout_is_rank0s": torch.equal(layout, reference.model.attention.master_layout),
            "density": float(layout.float().mean()),
            "config_type": type(engine.sparse_attention_config(HEADS)).__name__,
        }
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_sparse_attention_model_trains_under_zero2_like_pytorch(tmp_path, world_size):
    reports = run_distributed(_train, world_size=world_size, tmp_path=tmp_path)
    for rank, report in enumerate(reports):
        changed, is_rank0s = report.pop("first_forward_syncs")
        assert is_rank0s and changed == (rank != 0), (rank, changed, is_rank0s)
        for name, result in report.items():
            assert result["layout_is_rank0s"], (rank, name)
            assert result["drawn_differs"] == (rank != 0), (rank, name)  # the sync had work to do
            assert result["density"] < 0.75, result  # a sparse layout, not the dense one
            assert result["config_type"] == "BigBirdSparsityConfig"
            # fp32: a rank on another layout, or a missed update, is off by far more than these.
            # (A key bias would get a gradient that is zero up to rounding, since a softmax
            # ignores a per-row constant, and Adam would scale that noise to lr-sized steps.)
            assert result["movement"] > 1e-2, result
            assert result["update_error"] < 1e-5, (rank, name, result)
            assert result["diff"] < 1e-5, (rank, name, result)
