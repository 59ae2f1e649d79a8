"""ZeRO-3 with a module called twice in one forward, in two branches whose backwards
interleave (a siamese tower, a shared adapter): the first branch's backward through it must
not free what the second still needs. Frozen and trainable modules, 2 ranks, against
single-process training on the same global batches (SGD and AdamW)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, max_param_diff, reference_run

MICRO, STEPS = 2, 2
LR = {"SGD": 0.5, "AdamW": 1e-2}


class _TwoBranches(nn.Module):
    """``shared`` runs on two different inputs; their outputs meet only at the loss, so
    autograd walks the second call's backward before the first's."""

    def __init__(self, frozen: bool, vocab: int = 32, width: int = 16):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(vocab, width)
        self.left, self.right = nn.Linear(width, width), nn.Linear(width, width)
        self.shared = nn.Linear(width, width).requires_grad_(not frozen)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        a = self.shared(torch.tanh(self.left(h)))
        b = self.shared(torch.tanh(self.right(h)))
        logits = self.head(a * b)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _train(rank, world_size, frozen):
    out = {}
    for optimizer in ("SGD", "AdamW"):
        model = _TwoBranches(frozen)
        batches = token_batches(num_steps=STEPS, batch=MICRO * world_size, seed=4)
        cls = getattr(torch.optim, optimizer)
        reference = reference_run(model, batches, lr=LR[optimizer], clip=0.0, optimizer=cls)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": optimizer, "params": {"lr": LR[optimizer]}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
        }
        engine, *_ = shardwise.initialize(model=copy.deepcopy(model), config=config)
        for tokens, targets in batches:
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(tokens[mine], targets[mine]))
            engine.step()
        out[optimizer] = max_param_diff(reference.model, engine.module)
    return out


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_a_module_called_in_two_branches_trains_as_single_process(tmp_path, frozen):
    for rank, diffs in enumerate(run_distributed(_train, world_size=2, tmp_path=tmp_path, frozen=frozen)):
        for optimizer, diff in diffs.items():
            assert diff < 2e-5, f"rank {rank} {optimizer}: max |diff| {diff} against single-process training"
