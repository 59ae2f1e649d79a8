"""Pipeline parallelism on 2 and 4 gloo ranks: PipelineModule + train_batch match
single-process PyTorch on the same global batches (pp2, pp4, pp2 x dp2 at ZeRO 0-3,
tied embedding/head, accumulation 1/4/8, activation checkpointing, the gpipe and
zero-bubble schedules), and each stage holds only its own layers."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.testing import run_distributed

V, H, S, MICRO, STEPS, LR, BASE_SEED = 32, 16, 6, 2, 3, 0.5, 1234


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def head(embedding, x):  # the output head reuses the embedding's weight
    return x @ embedding.weight.t()


def _specs(num_blocks: int, tied: bool):
    first = TiedLayerSpec("embed", nn.Embedding, V, H) if tied else LayerSpec(nn.Embedding, V, H)
    last = TiedLayerSpec("embed", nn.Embedding, V, H, forward_fn=head) if tied else LayerSpec(nn.Linear, H, V)
    return [first] + [LayerSpec(Block, H) for _ in range(num_blocks)] + [last]


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


class Reference(nn.Module):
    """The same layers in one process, each built after seeding base_seed + its index."""

    def __init__(self, specs):
        super().__init__()
        self.layers = nn.ModuleList()
        self.funcs = []
        tied = {}
        for index, spec in enumerate(specs):
            torch.manual_seed(BASE_SEED + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                    self.layers.append(tied[spec.key])
                module = tied[spec.key]
                self.funcs.append(module if spec.forward_fn is None else (lambda x, m=module, f=spec.forward_fn: f(m, x)))
            else:
                module = spec.build()
                self.layers.append(module)
                self.funcs.append(module)

    def forward(self, x):
        for fn in self.funcs:
            x = fn(x)
        return x


def _batches(gbs):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, V, (gbs, S), generator=g), torch.randint(0, V, (gbs, S), generator=g))
            for _ in range(STEPS)]


def _case(rank, world_size, *, stages, gas, zero=0, tied=False, schedule="1f1b", interval=0, blocks=4, opt="SGD"):
    specs = _specs(blocks, tied)
    reference = Reference(specs)
    initial = copy.deepcopy(reference)
    dp = world_size // stages
    batches = _batches(MICRO * gas * dp)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR) if opt == "SGD" else \
        torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    ref_losses = []
    for tokens, labels in batches:
        loss = _loss(reference(tokens), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    model = PipelineModule(specs, num_stages=stages, loss_fn=_loss, seed_layers=True, base_seed=BASE_SEED,
                           partition_method="uniform", activation_checkpoint_interval=interval)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "optimizer": {"type": opt, "params": {"lr": LR} if opt == "SGD" else {"lr": 1e-2, "weight_decay": 0.0}},
              "steps_per_print": 1000, "pipeline": {"schedule": schedule},
              "zero_optimization": {"stage": zero, "reduce_bucket_size": 300}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    dp_rank = engine.grid.get_data_parallel_rank()
    losses = []
    for tokens, labels in batches:
        micro = [(tokens[(m * dp + dp_rank) * MICRO:(m * dp + dp_rank + 1) * MICRO],
                  labels[(m * dp + dp_rank) * MICRO:(m * dp + dp_rank + 1) * MICRO]) for m in range(gas)]
        losses.append(float(engine.train_batch(iter(micro))))
    # compare this stage's parameters with the reference's layers of the same index
    from shardwise.zero import GatheredParameters

    ref_layers = {}
    owner = {}
    for index, spec in enumerate(specs):
        key = f"tied_modules.{spec.key}" if isinstance(spec, TiedLayerSpec) else str(index)
        owner.setdefault(key, index)
    ref_by_index = {}
    position = 0
    seen = {}
    for index, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue
            seen[spec.key] = position
        ref_by_index[f"tied_modules.{spec.key}" if isinstance(spec, TiedLayerSpec) else str(index)] = \
            reference.layers[position]
        position += 1
    diff = 0.0
    names = []
    with GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            layer_key, _, attr = name.rpartition(".") if name.startswith("tied_modules") else name.partition(".")
            if name.startswith("tied_modules"):
                layer_key, attr = ".".join(name.split(".")[:2]), ".".join(name.split(".")[2:])
            ref_p = dict(ref_by_index[layer_key].named_parameters())[attr]
            diff = max(diff, (p.detach() - ref_p.detach()).abs().max().item())
            names.append(name)
    moved = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(reference.parameters(),
                                                                             initial.parameters()))
    return {"losses": (losses, ref_losses), "diff": diff, "moved": moved, "names": names,
            "parts": engine.module.parts, "stage": engine.grid.stage_id}


def _run(rank, world_size, cases):
    return {name: _case(rank, world_size, **kwargs) for name, kwargs in cases.items()}


def _check(reports, cases):
    for rank, report in enumerate(reports):
        for name in cases:
            got = report[name]
            losses, ref_losses = got["losses"]
            for mine, ref in zip(losses, ref_losses):
                assert abs(mine - ref) <= 1e-5 * abs(ref), f"rank {rank} {name}: loss {mine} vs {ref}"
            tol = 1e-4 if cases[name].get("opt", "SGD") == "SGD" else 2e-3
            assert got["diff"] <= tol * got["moved"], f"rank {rank} {name}: |diff| {got['diff']:.3g} vs moved {got['moved']:.3g}"
            parts, stage = got["parts"], got["stage"]
            mine = {int(n.split(".")[0]) for n in got["names"] if not n.startswith("tied_modules")}
            tied_only = any(n.startswith("tied_modules") for n in got["names"])
            assert (mine or tied_only) and all(parts[stage] <= i < parts[stage + 1] for i in mine), \
                f"rank {rank} {name}: stage {stage} holds layers {sorted(mine)} outside {parts}"


TWO_RANKS = {
    "pp2 gas1": dict(stages=2, gas=1),
    "pp2 gas4": dict(stages=2, gas=4),
    "pp2 gas8 adamw": dict(stages=2, gas=8, opt="AdamW"),
    "pp2 tied gas4": dict(stages=2, gas=4, tied=True),
    "pp2 gpipe": dict(stages=2, gas=4, schedule="gpipe"),
    "pp2 zero bubble": dict(stages=2, gas=4, schedule="zero_bubble"),
    "pp2 checkpointed": dict(stages=2, gas=4, interval=1),
}
FOUR_RANKS = {
    **{f"pp2 dp2 zero{z}": dict(stages=2, gas=4, zero=z) for z in (0, 1, 2, 3)},
    "pp2 dp2 tied zero1": dict(stages=2, gas=4, zero=1, tied=True),
    "pp4 tied": dict(stages=4, gas=4, tied=True, blocks=4),
}


def test_pipeline_two_stages_match_single_process(tmp_path):
    _check(run_distributed(_run, world_size=2, tmp_path=tmp_path, cases=TWO_RANKS), TWO_RANKS)


def test_pipeline_with_data_parallel_zero_and_four_stages(tmp_path):
    _check(run_distributed(_run, world_size=4, tmp_path=tmp_path, cases=FOUR_RANKS), FOUR_RANKS)
