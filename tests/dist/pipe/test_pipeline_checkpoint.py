"""Pipeline checkpoints are one model's: a pp2 x dp2 run with tied layers (SGD with
momentum, ZeRO 0-3, stage 3 partitioning every layer) saves; pp4, pp2 x dp2 and pp1 on one process load
it and continue, matching single-process training of the same steps; consolidate() names
every layer with its full shape; module_state_dict() and save_16bit_model give the whole
model, and load_module_state_dict() takes it back at another stage count. A stage names
its layers by global index, checked by value on layers of one shape."""

from functools import partial

import torch
import torch.nn.functional as F

import shardwise
from shardwise.pipe import PipelineModule, TiedLayerSpec
from shardwise.testing import run_distributed
from shardwise.testing.models import pipeline_specs

V, H, S, MICRO, GBS, LR, MOMENTUM, BASE_SEED = 32, 16, 6, 2, 8, 0.3, 0.9, 1234
SAVED_STEPS, MORE_STEPS = 2, 2
SAVES = {"z0": (0, True), "z1": (1, True), "z2": (2, True), "z3": (3, True)}
"""Checkpoint name: (ZeRO stage of the pp2 x dp2 run saving it, tied layers)."""


def _specs(tied: bool):
    return pipeline_specs(4, tied=tied, vocab=V, width=H)


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def _reference(steps: int, tied: bool = True) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    """Single-process training of ``steps`` batches: (parameters by pipeline name after
    them, the losses, the initial parameters)."""
    layers, funcs = {}, []
    for index, spec in enumerate(_specs(tied)):
        key = f"tied_modules.{spec.key}" if isinstance(spec, TiedLayerSpec) else str(index)
        if key not in layers:
            torch.manual_seed(BASE_SEED + index)
            layers[key] = spec.build()
        forward_fn = getattr(spec, "forward_fn", None)
        funcs.append(layers[key] if forward_fn is None else partial(forward_fn, layers[key]))
    params = {f"{key}.{n}": p for key, layer in layers.items() for n, p in layer.named_parameters()}
    initial = {n: p.detach().clone() for n, p in params.items()}
    optimizer = torch.optim.SGD(params.values(), lr=LR, momentum=MOMENTUM)
    losses = []
    for tokens, labels in _batches()[:steps]:
        x = tokens
        for fn in funcs:
            x = fn(x)
        loss = _loss(x, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {n: p.detach().clone() for n, p in params.items()}, losses, initial


def _batches():
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, V, (GBS, S), generator=g), torch.randint(0, V, (GBS, S), generator=g))
        for _ in range(SAVED_STEPS + MORE_STEPS)
    ]


def _engine(stages: int, world_size: int, zero: int, tied: bool = True):
    model = PipelineModule(
        _specs(tied),
        num_stages=stages,
        loss_fn=_loss,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method="uniform",
    )
    dp = world_size // stages
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GBS // (MICRO * dp),
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": zero,
            "reduce_bucket_size": 300,
            **({"stage3_param_persistence_threshold": 0} if zero == 3 else {}),
        },
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    return engine


def _train(engine, steps: range) -> list[float]:
    dp, dp_rank = engine.grid.data, engine.grid.get_data_parallel_rank()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for tokens, labels in [_batches()[s] for s in steps]:
        rows = [slice((m * dp + dp_rank) * MICRO, (m * dp + dp_rank + 1) * MICRO) for m in range(gas)]
        losses.append(float(engine.train_batch(iter([(tokens[r], labels[r]) for r in rows]))))
    return losses


def _diff(engine, expected: dict[str, torch.Tensor]) -> float:
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return max((p.detach() - expected[n]).abs().max().item() for n, p in engine.module.named_parameters())


def _save_then_resume(rank, world_size, *, root):
    """pp2 x dp2 saves at each ZeRO stage; the whole model's state dict is checked on the
    way; then pp2 x dp2 and pp4 load and continue (a report per case)."""
    report = {}
    for saved, (zero, tied) in SAVES.items():
        engine = _engine(2, world_size, zero, tied)
        losses = _train(engine, range(SAVED_STEPS))
        engine.save_checkpoint(f"{root}/{saved}", tag="saved")
        state = engine.module_state_dict()
        engine.save_16bit_model(f"{root}/{saved}", "model.bin")
        engine.save_16bit_model(f"{root}/{saved}", "model.safetensors")
        report[f"save {saved}"] = {"losses": losses, "state": {k: v.clone() for k, v in state.items()}}
        if saved == "z0":  # the whole state dict loads at another stage count
            engine = _engine(4, world_size, 1)
            engine.load_module_state_dict({"module": state})
            report["state dict at pp4"] = {"losses": [], "diff": _diff(engine, _reference(SAVED_STEPS)[0])}
    for stages, saved, zero in [
        (2, "z0", 0),
        (2, "z1", 1),
        (2, "z2", 2),
        (4, "z1", 0),
        (4, "z2", 1),
        (4, "z0", 2),
        (4, "z3", 3),
        (2, "z2", 3),
    ]:
        tied = SAVES[saved][1]
        engine = _engine(stages, world_size, zero, tied)
        engine.load_checkpoint(f"{root}/{saved}", tag="saved")
        losses = _train(engine, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected, _, _ = _reference(SAVED_STEPS + MORE_STEPS, tied)
        report[f"pp{stages} z{zero} from {saved}"] = {"losses": losses, "diff": _diff(engine, expected)}
    return report


def _resume_on_one(rank, world_size, *, root):
    report = {}
    for saved, (_, tied) in SAVES.items():
        engine = _engine(1, world_size, 0, tied)
        engine.load_checkpoint(f"{root}/{saved}", tag="saved")
        losses = _train(engine, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        expected, _, _ = _reference(SAVED_STEPS + MORE_STEPS, tied)
        report[f"pp1 from {saved}"] = {"losses": losses, "diff": _diff(engine, expected)}
    return report


def test_pipeline_checkpoint_loads_at_other_stage_counts(tmp_path):
    root = tmp_path / "checkpoints"
    reports = run_distributed(_save_then_resume, world_size=4, tmp_path=tmp_path, root=str(root))
    reports += run_distributed(_resume_on_one, world_size=1, tmp_path=tmp_path, root=str(root))
    references = {}
    for tied in (True, False):
        after_save, save_losses, _ = _reference(SAVED_STEPS, tied)
        final, all_losses, initial = _reference(SAVED_STEPS + MORE_STEPS, tied)
        moved = max((final[n] - initial[n]).abs().max().item() for n in final)
        references[tied] = after_save, save_losses, all_losses[SAVED_STEPS:], moved
    checked = set()
    for rank, report in enumerate(reports):
        for case, got in report.items():
            checked.add(case)
            after_save, save_losses, resumed_losses, moved = references["untied" not in case]
            want = save_losses if case.startswith("save") else resumed_losses if got["losses"] else []
            for mine, ref in zip(got["losses"], want, strict=True):
                assert abs(mine - ref) <= 1e-5 * abs(ref), f"rank {rank} {case}: loss {mine} vs {ref}"
            if case.startswith("save"):  # every rank has the whole model's state dict
                assert set(got["state"]) == set(after_save), f"rank {rank} {case}: {sorted(got['state'])}"
                for name, value in got["state"].items():
                    assert torch.allclose(value, after_save[name], atol=1e-5), f"rank {rank} {case}: {name}"
            else:
                assert got["diff"] <= 1e-4 * moved, f"rank {rank} {case}: |diff| {got['diff']:.3g} vs moved {moved:.3g}"
    assert len(checked) == len(SAVES) * 2 + 9, sorted(checked)
    for saved, (_, tied) in SAVES.items():
        after_save = references[tied][0]
        directory = root / saved
        consolidated = shardwise.checkpoint.consolidate(directory, "saved")
        assert {k: tuple(v.shape) for k, v in consolidated.items()} == {
            k: tuple(v.shape) for k, v in after_save.items()
        }, f"{saved}: {sorted(consolidated)}"
        for name, value in consolidated.items():
            assert torch.allclose(value, after_save[name], atol=1e-5), f"{saved} consolidated {name}"
        from safetensors.torch import load_file

        for exported in (torch.load(directory / "model.bin"), load_file(directory / "model.safetensors")):
            assert list(exported) == list(after_save) or set(exported) == set(after_save), sorted(exported)
            for name, value in exported.items():
                assert torch.allclose(value, after_save[name], atol=1e-5), f"{saved} exported {name}"


def _same_shaped_specs():
    """Four blocks of one shape: a layer under another layer's name has the right shape and
    only its values can tell."""
    from shardwise.pipe import LayerSpec
    from shardwise.testing.models import PipelineBlock

    return [LayerSpec(PipelineBlock, H) for _ in range(4)]


def _names_held(rank, world_size, *, root):
    """pp2 of four same-shaped blocks: each stage's state dict, saved as a checkpoint."""
    model = PipelineModule(
        _same_shaped_specs(),
        num_stages=2,
        loss_fn=F.mse_loss,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method="uniform",
    )
    engine, *_ = shardwise.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
        },
    )
    engine.save_checkpoint(root, tag="built")
    return {name: value.clone() for name, value in engine.module.state_dict().items()}


def test_stages_name_their_layers_by_global_index_by_value(tmp_path):
    """Stage 1 of a pp2 model holds layers 2 and 3 under the names ``2.*`` and ``3.*`` (not
    its local ``0.*`` / ``1.*``): each stage's tensors, and the checkpoint read back whole,
    equal tensor by tensor the single-process layer built with that global index's seed."""
    root = tmp_path / "checkpoint"
    reports = run_distributed(_names_held, world_size=2, tmp_path=tmp_path, root=str(root))
    reference = {}
    for index, spec in enumerate(_same_shaped_specs()):
        torch.manual_seed(BASE_SEED + index)
        reference.update({f"{index}.{n}": t for n, t in spec.build().state_dict().items()})
    consolidated = shardwise.checkpoint.consolidate(root, "built")
    for where, state in [*((f"stage {rank}", held) for rank, held in enumerate(reports)), ("checkpoint", consolidated)]:
        for name, value in state.items():
            twins = [n for n, t in reference.items() if t.shape == value.shape and torch.equal(t, value)]
            assert name in twins, f"{where}: {name} holds the values of {twins or 'no layer'}"
    assert sorted(reports[0]) + sorted(reports[1]) == sorted(reference) == sorted(consolidated)
