"""``save_checkpoint(exclude_frozen_parameters=True)`` on 2 ranks at ZeRO 2 and 3, SGD and
AdamW: a frozen base Linear under a trainable adapter trains 2 steps and is saved without
the base; the checkpoint holds no frozen tensor (it is smaller than the full one by the
base's bytes, and no file names a base key); an engine built from the same base weights
(its trainable parameters scrambled) loads it, at the same ZeRO stage (SGD) or the other
one (AdamW), and its third step gives the loss and parameters of the run that went on
(bit-identical at the same stage), and of single-process PyTorch."""

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.checkpoints import stored_tensor_names
from shardwise.testing.parity import STAGE3_PARTITION_ALL, full_parameters

WIDTH, MICRO = 48, 2
LR = {"SGD": 0.1, "AdamW": 1e-2}
TOLERANCE = 2e-5  # fp32: reduction order only
FROZEN_BYTES = (WIDTH * WIDTH + WIDTH) * 4


class _Adapted(nn.Module):
    """A frozen ``base`` Linear plus a trainable low-rank ``adapter``, a trainable head and a buffer."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.down = nn.Linear(WIDTH, 2, bias=False)
        self.up = nn.Linear(2, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, 4)
        self.register_buffer("scale", torch.tensor(0.5))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)

    def forward(self, x, y):
        h = F.gelu(self.base(x) + self.scale * self.up(self.down(x)))
        return F.mse_loss(self.head(h), y)


def _batches(world_size: int, steps: int = 3):
    generator = torch.Generator().manual_seed(4)
    n = MICRO * world_size
    return [(torch.randn(n, WIDTH, generator=generator), torch.randn(n, 4, generator=generator)) for _ in range(steps)]


def _config(stage: int, optimizer: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": optimizer, "params": {"lr": LR[optimizer], "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, **(STAGE3_PARTITION_ALL if stage == 3 else {})},
    }


def _reference_losses(model, batches, optimizer: str) -> tuple[list[float], dict]:
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    step = getattr(torch.optim, optimizer)(trainable, lr=LR[optimizer], weight_decay=0.0)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        step.step()
        step.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def _step(engine, batch, rank) -> float:
    x, y = batch
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    loss = engine(x[mine], y[mine])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _files(directory: Path) -> dict:
    """Bytes of the checkpoint directory and every tensor name in it (its files' and its manifest's)."""
    return {"bytes": sum(p.stat().st_size for p in directory.iterdir()), "names": stored_tensor_names(directory)}


def _save_and_resume(rank, world_size, checkpoint_dir):
    report = {}
    base_model = _Adapted()
    batches = _batches(world_size)
    for stage in (2, 3):
        for optimizer in ("SGD", "AdamW"):
            config = _config(stage, optimizer)
            where = Path(checkpoint_dir) / f"stage{stage}-{optimizer}"
            engine, *_ = shardwise.initialize(model=copy.deepcopy(base_model), config=config)
            for batch in batches[:2]:
                _step(engine, batch, rank)
            engine.save_checkpoint(where, tag="adapters", exclude_frozen_parameters=True)
            engine.save_checkpoint(where, tag="everything")
            went_on = _step(engine, batches[2], rank)
            went_on_params = full_parameters(engine)

            fresh_model = copy.deepcopy(base_model)  # the same base weights, other trainable ones
            with torch.no_grad():
                for p in fresh_model.parameters():
                    if p.requires_grad:
                        p.mul_(-2.0)
            resumed_at = stage if optimizer == "SGD" else 5 - stage  # AdamW: load at the other stage
            resumed, *_ = shardwise.initialize(model=fresh_model, config=_config(resumed_at, optimizer))
            resumed.load_checkpoint(where, tag="adapters")
            loss = _step(resumed, batches[2], rank)
            params = full_parameters(resumed)
            losses, reference = _reference_losses(base_model, batches, optimizer)
            report[stage, optimizer] = {
                "files": {tag: _files(where / tag) for tag in ("adapters", "everything")},
                "loss vs went on": abs(loss - went_on),
                "params vs went on": max((params[n] - went_on_params[n]).abs().max().item() for n in params),
                "loss": loss,
                "reference loss": losses[2],
                "params vs reference": max((params[n] - reference[n]).abs().max().item() for n in reference),
            }
    return report


def test_checkpoint_without_frozen_parameters_resumes_as_never_saved(tmp_path):
    reports = run_distributed(_save_and_resume, world_size=2, tmp_path=tmp_path, checkpoint_dir=str(tmp_path))
    for (stage, optimizer), case in reports[0].items():
        where = f"ZeRO {stage} {optimizer}"
        adapters, everything = case["files"]["adapters"], case["files"]["everything"]
        smaller = everything["bytes"] - adapters["bytes"]
        assert FROZEN_BYTES <= smaller < FROZEN_BYTES + 1024, f"{where}: smaller by {smaller}, frozen {FROZEN_BYTES}"
        assert not [n for n in adapters["names"] if n.startswith("base.")], f"{where}: frozen tensors saved: {adapters}"
        assert {"base.weight", "base.bias", "scale"} <= set(everything["names"]), f"{where}: {everything}"
        assert "scale" in adapters["names"], f"{where}: the buffer was left out too: {adapters}"
        mean_loss = (case["loss"] + reports[1][stage, optimizer]["loss"]) / 2
        assert abs(mean_loss - case["reference loss"]) < TOLERANCE, f"{where}: loss {mean_loss} vs {case}"
        for rank, report in enumerate(reports):
            got = report[stage, optimizer]
            same = optimizer == "SGD"  # resumed at the same stage: bit-identical; else reduction order differs
            limit = 0.0 if same else TOLERANCE
            assert got["loss vs went on"] <= limit and got["params vs went on"] <= limit, f"rank {rank} {where}: {got}"
            assert got["params vs reference"] < TOLERANCE, f"rank {rank} {where}: {got}"


def _pipeline(seed_scale: float):
    from shardwise.pipe import PipelineModule

    generator = torch.Generator().manual_seed(6)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)]
    with torch.no_grad():
        for index, layer in enumerate(layers):
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * (0.3 if index % 2 == 0 else 0.3 * seed_scale))
    for frozen in (layers[0], layers[2]):  # a frozen base on each stage
        frozen.requires_grad_(False)
    return PipelineModule(layers, num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")


def _pipeline_stages(rank, world_size, checkpoint_dir):
    """pp2: each stage leaves its own frozen layer out; a fresh pipeline resumes bit-identically."""
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    }
    generator = torch.Generator().manual_seed(7)
    data = [(torch.randn(MICRO, 8, generator=generator), torch.randn(MICRO, 4, generator=generator)) for _ in range(6)]
    engine, *_ = shardwise.initialize(model=_pipeline(1.0), config=config)
    for step in range(2):
        engine.train_batch(iter(data[2 * step : 2 * step + 2]))
    engine.save_checkpoint(checkpoint_dir, tag="adapters", exclude_frozen_parameters=True)
    went_on = engine.train_batch(iter(data[4:])).item()
    resumed, *_ = shardwise.initialize(model=_pipeline(-2.0), config=config)
    resumed.load_checkpoint(checkpoint_dir, tag="adapters")
    loss = resumed.train_batch(iter(data[4:])).item()
    params = {n: (p - engine.module.get_parameter(n)).abs().max().item() for n, p in resumed.module.named_parameters()}
    manifest = json.loads((Path(checkpoint_dir) / "adapters" / "manifest.json").read_text())
    return loss - went_on, params, _files(Path(checkpoint_dir) / "adapters")["names"], manifest["skeletons"]["frozen"]


def test_pipeline_stages_leave_their_frozen_layers_out(tmp_path):
    reports = run_distributed(_pipeline_stages, world_size=2, tmp_path=tmp_path, checkpoint_dir=str(tmp_path))
    for rank, (loss, params, names, frozen) in enumerate(reports):
        assert frozen == ["0.bias", "0.weight", "2.bias", "2.weight"], f"rank {rank}: recorded frozen {frozen}"
        assert not set(frozen) & set(names) and {"1.weight", "3.weight"} <= set(names), f"rank {rank}: {names}"
        assert loss == 0.0 and max(params.values()) == 0.0, f"rank {rank}: resumed off by {loss}, {params}"
