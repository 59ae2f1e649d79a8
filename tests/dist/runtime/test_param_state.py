"""DeepSpeed's per-parameter state functions (``deepspeed.utils.safe_get_full_*``),
``engine.offload_states`` and the ``zero_to_fp32`` functions, at every ZeRO stage on 2
ranks, checked against single-process PyTorch training on the same global batches."""

import copy

import pytest
import torch

import shardwise
import shardwise.comm as dist
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL
from shardwise.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from shardwise.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

MICRO, LR = 2, 0.05


def _config(stage, optimizer, bf16=False):
    zero = {"stage": stage, **(STAGE3_PARTITION_ALL if stage == 3 else {})}
    return {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": optimizer, "params": {"lr": LR, "weight_decay": 0.01 if optimizer == "AdamW" else 0.0}},
        "zero_optimization": zero,
    }


def _micro(batch, rank):
    tokens, targets = batch
    return tokens[rank * MICRO : (rank + 1) * MICRO], targets[rank * MICRO : (rank + 1) * MICRO]


def _params(rank, world_size, stage, optimizer, tmp, bf16=False):
    torch.manual_seed(0)
    model = TinyMLP(width=24)
    reference = copy.deepcopy(model)
    ref_opt = (
        torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
        if optimizer == "AdamW"
        else torch.optim.SGD(reference.parameters(), lr=LR)
    )
    engine, _, _, _ = shardwise.initialize(model=model, config=_config(stage, optimizer, bf16))
    names = dict(engine.module.named_parameters())
    batches = token_batches(num_steps=3, batch=MICRO * world_size, seed=4)
    out = {"grad": 0.0, "master": 0.0, "state": 0.0}
    for _step, batch in enumerate(batches):
        reference(*batch).backward()
        engine.backward(engine(*_micro(batch, rank)))
        # between backward and step: the reduced full gradient, collective at stages 1-3
        for name, p in names.items():
            out["grad"] = max(
                out["grad"], (safe_get_full_grad(p).float() - reference.get_parameter(name).grad).abs().max().item()
            )
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
    for name, p in names.items():
        ref = reference.get_parameter(name)
        out["master"] = max(out["master"], (safe_get_full_fp32_param(p) - ref).abs().max().item())
        if optimizer == "AdamW":
            state = safe_get_full_optimizer_state(p, "exp_avg")
            out["state"] = max(out["state"], (state - ref_opt.state[ref]["exp_avg"]).abs().max().item())
    # the split: this rank's fp32 part of fc1.weight, and the parts of all ranks make the whole
    local = safe_get_local_fp32_param(names["fc1.weight"])
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    out["local_numel"] = local.numel()
    whole = safe_get_full_fp32_param(names["fc1.weight"]).reshape(-1)
    out["parts_equal_full"] = torch.equal(local if stage == 0 else torch.cat(parts), whole)
    out["missing_state"] = safe_get_full_optimizer_state(names["fc1.weight"], "no_such_key")

    # setting: a new master becomes the parameter the next forward uses
    new = torch.full_like(reference.fc2.weight, 0.125)
    safe_set_full_fp32_param(names["fc2.weight"], new)
    with shardwise.zero.GatheredParameters([names["fc2.weight"]]):
        out["set_param"] = torch.equal(names["fc2.weight"].detach().float(), new)  # 0.125 is exact in bf16
    out["set_master"] = torch.equal(safe_get_full_fp32_param(names["fc2.weight"]), new)
    if optimizer == "AdamW":
        safe_set_full_optimizer_state(names["fc2.weight"], torch.ones_like(new), "exp_avg")
        out["set_state"] = torch.equal(
            safe_get_full_optimizer_state(names["fc2.weight"], "exp_avg"), torch.ones_like(new)
        )

    # zero_to_fp32 over a checkpoint equals the live fp32 masters
    engine.save_checkpoint(tmp / "ckpt", client_state={"step": 3})
    live = {name: safe_get_full_fp32_param(p) for name, p in names.items()}
    if rank == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(tmp / "ckpt")
        out["consolidated"] = max((state[name] - value).abs().max().item() for name, value in live.items())
        convert_zero_checkpoint_to_fp32_state_dict(tmp / "ckpt", tmp / "out", max_shard_size=3000)
        index = (tmp / "out" / "pytorch_model.bin.index.json").read_text()
        out["shards"] = len(list((tmp / "out").glob("pytorch_model-*-of-*.bin")))
        merged = {}
        for file in sorted((tmp / "out").glob("pytorch_model-*.bin")):
            merged.update(torch.load(file))
        out["converted"] = max((merged[name] - value).abs().max().item() for name, value in live.items())
        out["index_names"] = all(name in index for name in live)
        plain = load_state_dict_from_zero_checkpoint(TinyMLP(width=24), tmp / "ckpt")
        out["loaded"] = max((plain.get_parameter(name) - value).abs().max().item() for name, value in live.items())
    return out


@pytest.mark.parametrize(
    "stage,optimizer,bf16,world_size",
    [
        (0, "AdamW", False, 2),
        (1, "SGD", False, 2),
        (2, "AdamW", False, 2),
        (2, "SGD", True, 2),
        (3, "AdamW", False, 2),
        (3, "SGD", False, 2),
        (2, "SGD", False, 4),
        (3, "AdamW", False, 4),
    ],
)
def test_safe_get_set_and_zero_to_fp32_match_pytorch(tmp_path, stage, optimizer, bf16, world_size):
    results = run_distributed(
        _params, world_size=world_size, tmp_path=tmp_path, stage=stage, optimizer=optimizer, tmp=tmp_path, bf16=bf16
    )
    for r in results:
        # same global batches as single-process PyTorch: fp32 round-off only (bf16: its rounding,
        # still well below one SGD step's change of lr * grad ~ 1e-3)
        tol = 2e-2 if bf16 else 1e-5
        assert r["grad"] < tol and r["master"] < tol and r["state"] < tol, r
        assert r["parts_equal_full"] and r["missing_state"] is None, r
        assert r["set_param"] and r["set_master"] and r.get("set_state", True), r
    full = 2 * 24 * 24  # fc1.weight
    if stage == 0:
        assert results[0]["local_numel"] == full
    else:  # each rank holds only its part of the fp32 weights
        assert sum(r["local_numel"] for r in results) == full and all(r["local_numel"] < full for r in results)
    first = results[0]
    assert first["consolidated"] == 0.0 and first["converted"] == 0.0 and first["loaded"] == 0.0, first
    assert first["shards"] > 1 and first["index_names"], first


def _offload(rank, world_size, stage):
    torch.manual_seed(0)
    model = TinyMLP(width=24)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    engine, _, _, _ = shardwise.initialize(model=model, config=_config(stage, "AdamW"))
    out = {}
    for step, batch in enumerate(token_batches(num_steps=4, batch=MICRO * world_size, seed=5)):
        reference(*batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(*_micro(batch, rank)))
        engine.step()
        if step == 1:
            kinds = engine.strategy.views.state_tensors
            held = [
                t
                for kind in ("optim_states", "lp_grads", "lp_params")
                for t in kinds(kind)
                if t.untyped_storage().nbytes() > 0
            ]  # stage 3's sharded units hold none
            engine.offload_states()
            out["freed"] = all(t.untyped_storage().nbytes() == 0 for t in held)
            out["offloaded_bytes"] = engine._offloader.offloaded_bytes
            engine.reload_states()
            out["back"] = all(t.untyped_storage().nbytes() > 0 for t in held)
            engine.offload_states(include=["optim_states"])
            out["only_optimizer"] = all(
                t.untyped_storage().nbytes() > 0
                for t in held
                if any(t is u for u in kinds("lp_params") + kinds("lp_grads"))
            )
            engine.reload_states()
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        out["diff"] = max(
            (a - b.detach().float()).abs().max().item()
            for a, b in zip(reference.parameters(), engine.module.parameters())
        )
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_offload_states_frees_and_restores(tmp_path, stage):
    for r in run_distributed(_offload, world_size=2, tmp_path=tmp_path, stage=stage):
        assert r["freed"] and r["back"] and r["only_optimizer"] and r["offloaded_bytes"] > 0, r
        assert r["diff"] < 1e-5, r  # training after the round trip continues exactly
