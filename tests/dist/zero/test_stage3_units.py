"""Stage 3 units beyond one module's own parameters: modules whose forward reads a
child's parameters (torch's MultiheadAttention), leaf modules marked with
set_z3_leaf_modules (a mixture-of-experts-style layer that runs only some children), and
models that deep-copy partitioned layers under zero.Init (nn.TransformerEncoder)."""

import pytest
import torch
from torch import nn

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.parity import STAGE3_PARTITION_ALL

MICRO, LR, VOCAB, WIDTH = 2, 0.1, 40, 16


class Routed(nn.Module):
    """Runs one of its experts, chosen by the data: ranks call different children."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, h):
        return self.experts[int(h.detach().sum() > 0)](h)


class Model(nn.Module):
    def __init__(self, routed: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # deep-copies `layer`
        self.routed = Routed() if routed else nn.Identity()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        logits = self.head(self.routed(self.encoder(self.embed(tokens))))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))


def _train(rank, world_size, init, routed):
    torch.manual_seed(0)
    reference = Model(routed)
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
    }
    torch.manual_seed(0)
    with shardwise.zero.Init(config_dict_or_path=config, enabled=init):
        model = Model(routed)
    if init:  # zero.Init broadcast rank 0's values of the same seed: load the reference's anyway
        shardwise.zero.load_state_dict(model, reference.state_dict() if rank == 0 else None)
    if routed:
        shardwise.utils.set_z3_leaf_modules(model, [Routed])
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (MICRO * world_size, 6), generator=generator)
        # routing is decided per micro-batch, so the reference averages the micro-batch losses
        (sum(reference(tokens[r * MICRO : (r + 1) * MICRO]) for r in range(world_size)) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.backward(engine(tokens[rank * MICRO : (rank + 1) * MICRO]))
        engine.step()
    held = sum(p.numel() for p in model.parameters())  # partitioned: nothing whole between steps
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), engine.module.parameters()))
    return diff, held


@pytest.mark.parametrize("init,routed", [(False, False), (True, False), (False, True)])
def test_attention_leaves_and_deep_copied_layers_train_as_pytorch(tmp_path, init, routed):
    for diff, held in run_distributed(_train, world_size=2, tmp_path=tmp_path, init=init, routed=routed):
        assert diff < 1e-5 and held == 0, (diff, held)
