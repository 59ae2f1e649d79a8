"""ZeRO-3 partitions frozen parameters (``requires_grad=False``) as DeepSpeed does, on 2
ranks: a model with a frozen layer and a LoRA-style model (frozen base, trainable
adapters) train as single-process PyTorch on the same global batches (SGD and AdamW);
each rank stores only its slice of the frozen weights, which never change, and a frozen
unit is freed once the backward through it is done; a checkpoint round trip,
``module_state_dict``, the consolidated 16-bit state dict, ``save_16bit_model`` and
``zero_to_fp32`` give the frozen weights back whole."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, max_param_diff, reference_run

MICRO, STEPS = 2, 3
LR = {"SGD": 1.0, "AdamW": 1e-2}
TOLERANCE = 2e-5  # fp32: reduction order only


class _Lora(nn.Module):
    """PEFT's LoRA layer in its shape: a frozen ``base_layer`` plus ``lora_B(lora_A(x))``."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        with torch.no_grad():
            for p in (self.lora_A.weight, self.lora_B.weight):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class _LoraModel(nn.Module):
    """Frozen embedding and head around two LoRA layers over frozen linear layers."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.embed = nn.Embedding(vocab, width).requires_grad_(False)
        self.fc1 = _Lora(nn.Linear(width, 2 * width), 2, generator)
        self.fc2 = _Lora(nn.Linear(2 * width, width), 2, generator)
        self.head = nn.Linear(width, vocab).requires_grad_(False)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _config(optimizer: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": optimizer, "params": {"lr": LR[optimizer]}},
        "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
    }


def _frozen_unit_state_in_backward(engine) -> list[str]:
    """The state of fc1's frozen unit when the backward reaches ``norm`` (which runs before
    fc1 in the forward, so after fc1 in the backward)."""
    seen, weight = [], engine.module.fc1.weight
    if not hasattr(weight, "ds_tensor"):
        return ["never partitioned"]
    unit = engine.strategy.unit_of(weight)
    handle = engine.module.norm.register_full_backward_pre_hook(lambda *_: seen.append(unit.state.name))
    tokens, targets = token_batches(num_steps=1, batch=MICRO, seed=9)[0]
    engine.backward(engine(tokens, targets))
    handle.remove()
    engine.zero_grad()
    return seen


def _train(rank, world_size, checkpoint_dir):
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from shardwise.zero import GatheredParameters

    report = {}
    for kind, build in (("frozen layer", lambda: TinyMLP(seed=1, freeze_first=True)), ("lora", _LoraModel)):
        for optimizer in ("SGD", "AdamW"):
            model = build()
            batches = token_batches(num_steps=STEPS, batch=MICRO * world_size, seed=2)
            cls = getattr(torch.optim, optimizer)
            reference = reference_run(model, batches, lr=LR[optimizer], clip=0.0, optimizer=cls, weight_decay=0.0)
            engine, *_ = shardwise.initialize(model=copy.deepcopy(model), config=_config(optimizer))
            frozen = {n: p for n, p in engine.module.named_parameters() if not p.requires_grad}
            units = {engine.strategy.unit_of(p) for p in frozen.values() if hasattr(p, "ds_tensor")}
            held = {
                "whole": sum(p.numel() for p in frozen.values()),  # outside a forward: 0
                "shards": sum(u.master.numel() for u in units),
                "full": sum(u.numel for u in units),
                "grad shards": [u.grad_shard is not None for u in units],
                "in optimizer": any(u.master in s for s in engine.optimizer.state for u in units),
            }
            for tokens, targets in batches:
                mine = slice(rank * MICRO, (rank + 1) * MICRO)
                engine.backward(engine(tokens[mine], targets[mine]))
                engine.step()
            held["in optimizer"] |= any(u.master in engine.optimizer.state for u in units)
            with GatheredParameters(list(frozen.values())):
                unchanged = all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in frozen.items())
            report[kind, optimizer] = (max_param_diff(reference.model, engine.module), unchanged, held)
            if kind == "lora" and optimizer == "AdamW":
                report["checkpoint"] = _round_trip(engine, reference.model, checkpoint_dir, rank)
                fp32 = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)
                report["fp32"] = max((fp32[n] - p).abs().max().item() for n, p in reference.model.state_dict().items())
            if kind == "frozen layer" and optimizer == "SGD":
                report["in backward"] = _frozen_unit_state_in_backward(engine)
    report["bf16"] = _bf16(rank, world_size)
    return report


def _bf16(rank, world_size) -> tuple:
    """Under bf16 a frozen shard stays in bf16 (no fp32 copy) and its weights bit-identical."""
    from shardwise.zero import GatheredParameters

    model = _LoraModel()
    engine, *_ = shardwise.initialize(
        model=copy.deepcopy(model), config={**_config("AdamW"), "bf16": {"enabled": True}}
    )
    tokens, targets = token_batches(num_steps=1, batch=MICRO * world_size, seed=2)[0]
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    engine.backward(engine(tokens[mine], targets[mine]))
    engine.step()
    frozen = {n: p for n, p in engine.module.named_parameters() if not p.requires_grad}
    dtypes = sorted({str(engine.strategy.unit_of(p).master.dtype) for p in frozen.values()})
    with GatheredParameters(list(frozen.values())):
        initial = dict(model.named_parameters())
        unchanged = all(torch.equal(p, initial[n].to(torch.bfloat16)) for n, p in frozen.items())
    return dtypes, unchanged


def _round_trip(engine, reference, checkpoint_dir, rank) -> dict:
    """Save, load into an engine over a differently initialised model, compare."""
    engine.save_checkpoint(checkpoint_dir, tag="t")
    state = engine.module_state_dict()
    other, *_ = shardwise.initialize(model=_LoraModel(vocab=32, width=16).apply(_scramble), config=_config("AdamW"))
    other.load_checkpoint(checkpoint_dir, tag="t")
    consolidated = other._zero3_consolidated_16bit_state_dict()  # collective: every rank
    other.save_16bit_model(checkpoint_dir)
    saved = torch.load(f"{checkpoint_dir}/pytorch_model.bin") if rank == 0 else consolidated
    return {
        "loaded": max_param_diff(reference, other.module),
        "module_state_dict": max((state[n] - p).abs().max().item() for n, p in reference.state_dict().items()),
        **{
            name: max((got[n] - p).abs().max().item() for n, p in reference.state_dict().items()) if rank == 0 else 0.0
            for name, got in (("consolidated", consolidated), ("save_16bit_model", saved))
        },
    }


def _scramble(module):
    for p in module.parameters(recurse=False):
        with torch.no_grad():
            p.add_(1.0)


def test_frozen_parameters_are_partitioned_and_train_as_single_process(tmp_path):
    reports = run_distributed(
        _train, world_size=2, tmp_path=tmp_path, checkpoint_dir=str(tmp_path / "ckpt"), timeout_s=90
    )
    for rank, report in enumerate(reports):
        for kind in ("frozen layer", "lora"):
            for optimizer in ("SGD", "AdamW"):
                diff, unchanged, held = report[kind, optimizer]
                where = f"rank {rank} {kind} {optimizer}"
                assert diff < TOLERANCE, f"{where}: max |diff| {diff} against single-process training"
                assert unchanged, f"{where}: a frozen weight changed"
                assert held["whole"] == 0, f"{where}: {held['whole']} frozen elements kept whole"
                assert 2 * held["shards"] - held["full"] < 2 * 4, f"{where}: shards hold {held}"
                assert not any(held["grad shards"]) and not held["in optimizer"], f"{where}: {held}"
        assert report["in backward"] == ["SHARDED"], f"fc1's frozen unit not freed after its backward: {report}"
        checkpoint = report["checkpoint"]
        assert max(checkpoint.values()) < TOLERANCE, f"rank {rank}: frozen weights not whole again: {checkpoint}"
        assert report["fp32"] < TOLERANCE, f"zero_to_fp32 weights off by {report['fp32']}"
        assert report["bf16"] == (["torch.bfloat16"], True), f"rank {rank}: bf16 frozen shards {report['bf16']}"
