"""zero.Init: models built partitioned hold 1/N on every rank and train like plain ones."""

import copy
import weakref

import pytest
import torch
from torch import nn

import shardwise
from shardwise import zero
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, engine_train, max_param_diff, reference_run

MICRO, STEPS, LR, WD = 2, 3, 1e-2, 0.01


def _config(dtype="fp32", gas=2):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "gradient_clipping": 0.5,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 300, **STAGE3_PARTITION_ALL},
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


class _Watch:
    """Tracks the full-size parameter elements alive at each parameter registration."""

    def __init__(self):
        self.params: list[weakref.ref] = []
        self.peak = 0

    def __call__(self, module, name, param):
        if param is not None:
            self.params.append(weakref.ref(param))
            live = sum(p.numel() for p in (ref() for ref in self.params) if p is not None)
            self.peak = max(self.peak, live)


def _share_report(model, world_size):
    """(parameters left whole, largest shard excess over ceil(numel / N))."""
    whole = [n for n, p in model.named_parameters() if p.numel() != 0]
    excess = max(p.ds_tensor.numel() - -(-p.ds_numel // world_size) for p in model.parameters())
    return whole, excess


def _build_and_train(rank, world_size, dtype):
    watch = _Watch()
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(watch)
    try:
        with zero.Init(config_dict_or_path=_config(dtype)):
            model = TinyMLP(seed=1)
    finally:
        handle.remove()
    plain = TinyMLP(seed=1)
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in plain.modules())
    whole, excess = _share_report(model, world_size)
    shard_dtypes = {p.ds_tensor.dtype for p in model.parameters()}
    with zero.GatheredParameters(list(model.parameters())):
        built_diff = max((a - b.float()).abs().max().item() for a, b in zip(plain.parameters(), model.parameters()))
    batches = token_batches(num_steps=STEPS, batch=MICRO * 2 * world_size, seed=2)
    reference = reference_run(plain, batches, lr=LR, weight_decay=WD, clip=0.5)
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config(dtype))
    engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
    return {
        "whole": whole,
        "excess": excess,
        "peak": watch.peak,
        "largest_module": largest_module,
        "total": sum(p.numel() for p in plain.parameters()),
        "dtypes": shard_dtypes,
        "built_diff": built_diff,
        "trained_diff": max_param_diff(reference.model, engine.module),
        "update_error": reference.update_error(engine.module),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_built_in_init_holds_its_share_and_trains_like_plain(tmp_path, world_size):
    for out in run_distributed(_build_and_train, world_size=world_size, tmp_path=tmp_path, dtype="fp32"):
        assert out["whole"] == []  # every parameter is an empty tensor plus a 1/N slice
        assert out["excess"] == 0
        # one module's parameters at a time, never the model (the tied head registers the
        # embedding's parameter again, hence the embedding counted twice at most)
        assert out["peak"] <= 2 * out["largest_module"] < out["total"] + out["largest_module"]
        assert out["built_diff"] == 0.0  # rank 0's initial values, everywhere
        assert out["trained_diff"] < 2e-5


def test_init_takes_the_dtype_from_the_config(tmp_path):
    for out in run_distributed(_build_and_train, world_size=2, tmp_path=tmp_path, dtype="bf16"):
        assert out["dtypes"] == {torch.bfloat16}
        assert out["built_diff"] < 1e-2  # bf16 rounding of the initial values
        assert out["trained_diff"] < 5e-2
        # that bound exceeds what AdamW moves a weight in 3 steps (0.03); the update as a
        # whole (1.0 for none) must match the reference's (measured: 0.05)
        assert out["update_error"] < 0.15, out["update_error"]


def _meta(rank, world_size):
    torch.manual_seed(rank)  # different on every rank: zero.Init must make them agree
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 5))
    zero.Init(module=model)
    whole, excess = _share_report(model, world_size)
    with zero.GatheredParameters(list(model.parameters())):
        initial = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(7)
    plain = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 5))
    zero.load_state_dict(model, plain.state_dict() if rank == 0 else None)
    x = torch.randn(3, 6)
    with zero.GatheredParameters(list(model.parameters())):
        loaded_diff = (model(x) - plain(x)).abs().max().item()
    bad = dict(plain.state_dict())
    bad["3.weight"] = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"3\.weight has shape \(4, 8\) in the state dict and \(5, 8\)"):
        zero.load_state_dict(model, bad if rank == 0 else None)
    with pytest.raises(RuntimeError, match="missing keys"):
        zero.load_state_dict(
            model, {k: v for k, v in plain.state_dict().items() if k != "1.bias"} if rank == 0 else None
        )
    # the meta-built model trains under stage 3 like the plain one
    reference = copy.deepcopy(plain)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.randn(4 * world_size, 6, generator=torch.Generator().manual_seed(3))
    reference(data).square().mean().backward()
    optimizer.step()
    engine, _, _, _ = shardwise.initialize(
        model=model,
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
        },
    )
    engine.backward(engine(data[rank * 4 : (rank + 1) * 4]).square().mean())
    engine.step()
    return whole, excess, initial, loaded_diff, max_param_diff(reference, engine.module)


def test_meta_model_materialised_partitioned_then_loaded(tmp_path):
    results = run_distributed(_meta, world_size=2, tmp_path=tmp_path)
    for whole, excess, _initial, loaded_diff, trained_diff in results:
        assert whole == [] and excess == 0
        assert loaded_diff == 0.0
        assert trained_diff < 1e-6
    for a, b in zip(results[0][2], results[1][2]):  # reset_parameters() values agree across ranks
        assert torch.equal(a, b)


def _eval_engine(rank, world_size):
    """A model built by zero.Init under an engine with no optimizer (TRL's and
    DeepSpeed-Chat's reference model): its forward equals the plain model's, and each
    parameter's ds_status says whether it is whole."""

    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL}}
    with zero.Init(config_dict_or_path=config):
        model = TinyMLP(seed=1, freeze_first=True)  # frozen fc1 (DeepSpeed-Chat's LoRA base): partitioned too
    plain = TinyMLP(seed=1)
    engine, *_ = shardwise.initialize(model=model, config=config)
    frozen = engine.module.fc1.weight
    frozen = (hasattr(frozen, "ds_id"), frozen.ds_status.name, frozen.numel())
    tokens, targets = token_batches(num_steps=1, batch=MICRO, seed=2)[0]
    with torch.no_grad():
        same = torch.equal(engine(tokens, targets), plain(tokens, targets))
    param = engine.module.fc2.weight
    outside = (param.ds_status.name, param.numel())
    with zero.GatheredParameters([param]):
        inside = (param.ds_status.name, param.numel())
    # built whole (DeepSpeed-Chat's reference and reward models): partitioned all the same
    whole, *_ = shardwise.initialize(model=TinyMLP(seed=1), config=config)
    with torch.no_grad():
        same_whole = torch.equal(whole(tokens, targets), plain(tokens, targets))
    units = whole.strategy.buckets
    held = (sum(p.numel() for p in whole.module.parameters()), sum(u.master.numel() for u in units), len(units))
    return same, outside, inside, same_whole, held, frozen


def test_init_model_without_optimizer_runs_its_forward(tmp_path):
    total = sum(p.numel() for p in TinyMLP().parameters())
    for same, outside, inside, same_whole, held, frozen in run_distributed(
        _eval_engine, world_size=2, tmp_path=tmp_path
    ):
        assert same, "the forward of a zero.Init model under an engine without optimizer"
        assert outside == ("NOT_AVAILABLE", 0) and inside == ("AVAILABLE", 32 * 16), (outside, inside)
        assert same_whole, "the forward of a model built whole under an engine without optimizer"
        assert frozen == (True, "NOT_AVAILABLE", 0), f"a frozen zero.Init parameter left whole: {frozen}"
        whole_numel, shard_numel, units = held
        assert whole_numel == 0, f"{whole_numel} parameter elements left whole after a forward without grad"
        assert 0 <= 2 * shard_numel - total < 2 * units, f"rank holds {shard_numel} of {total} elements in shards"
