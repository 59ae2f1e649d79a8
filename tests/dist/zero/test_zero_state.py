"""ZeRO 1/2 memory accounting, fp16 overflow, and checkpoints that change stage and world size."""

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, engine_train, grad_bytes_outside
from shardwise.zero import GatheredParameters

MICRO = 2
GLOBAL_BATCH = 8


def _config(stage, world_size, **extra):
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, **STAGE3_PARTITION_ALL},
        **extra,
    }


def _memory(rank, world_size):
    out = {}
    batches = token_batches(num_steps=1, batch=GLOBAL_BATCH, seed=0)
    for stage in (0, 1, 2, 3):
        engine, _, _, _ = shardwise.initialize(
            model=TinyMLP(vocab=64, width=32, seed=1), config=_config(stage, world_size)
        )
        engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
        tokens, targets = batches[0]
        engine.backward(engine(tokens[:MICRO], targets[:MICRO]))  # gradients as they stand after backward
        # the live tensors, not only the strategy's own count: a .grad the strategy does not
        # know about (a full gradient left on a parameter) is memory too
        outside = grad_bytes_outside(engine.module, engine.strategy.views.state_tensors("lp_grads"))
        out[stage] = (
            engine.model_state_bytes(),
            len(getattr(engine.strategy, "buckets", [])),
            sum(p.numel() for p in engine.module.parameters()),
            len(list(engine.module.parameters())),
            outside,
        )
    engine, _, _, _ = shardwise.initialize(
        model=TinyMLP(vocab=64, width=32, seed=1), config=_config(3, world_size, bf16={"enabled": True})
    )
    engine_train(engine, batches, rank=rank, world_size=world_size, micro=MICRO)
    out["3 bf16"] = engine.model_state_bytes()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_optimizer_state_and_gradients_are_one_nth(tmp_path, world_size):
    for out in run_distributed(_memory, world_size=world_size, tmp_path=tmp_path):
        _check_memory(out, world_size)


def _check_memory(out, world_size):
    (s0, _, numel, tensors, _), (s1, b1, _, _, _), (s2, b2, _, _, _), (s3, b3, _, _, _) = (
        out[0],
        out[1],
        out[2],
        out[3],
    )
    # after backward every gradient byte is in the strategy's buffers (stages 0 and 1: the
    # .grad are views into them; stages 2 and 3: no .grad at all)
    assert [out[stage][4] for stage in range(4)] == [0, 0, 0, 0], "gradient bytes outside the strategy's buffers"
    assert s0.optimizer_state == 8 * numel + 4 * tensors  # two fp32 moments + a step per tensor
    # stage 1/2: two fp32 moments of each bucket shard (padding < world_size per bucket) + steps
    for state, buckets in ((s1, b1), (s2, b2)):
        moments = state.optimizer_state - 4 * buckets
        assert 8 * numel / world_size <= moments <= 8 * (numel / world_size + buckets)
        assert 4 * numel <= state.params <= 4 * (numel + buckets * world_size)  # whole, padded
    assert s0.params == s0.grads == 4 * numel
    assert 4 * numel <= s1.grads <= 4 * (numel + b1 * world_size)  # stage 1 keeps full gradients
    assert 4 * numel / world_size <= s2.grads <= 4 * (numel / world_size + b2)  # gradient shards
    assert s2.total < s1.total < s0.total
    # stage 3: nothing whole stays behind after the step; every state is a shard
    assert s3.params + s3.grads + s3.optimizer_state <= 16 * (numel / world_size + b3) + 4 * b3
    assert s3.total < s2.total
    # ZeRO's 16 bytes per parameter (fp32 master, gradient and two Adam moments) over N
    # ranks, within 5% (padding and the step counters are the rest), in fp32 and in bf16
    # (where the bf16 parameters are only ever gathered for the module in use)
    formula = 16 * numel / world_size
    for state in (s3, out["3 bf16"]):
        assert abs(state.total - formula) <= 0.05 * formula, (state, formula)


def _phase(rank, world_size, stage, save_dir, load, train_steps, save):
    torch.manual_seed(1234 + rank)
    engine, _, _, _ = shardwise.initialize(
        model=TinyMLP(vocab=64, width=32, seed=1 if not load else 7), config=_config(stage, world_size)
    )
    batches = token_batches(num_steps=6, batch=GLOBAL_BATCH, seed=5)
    if load:
        _, client = engine.load_checkpoint(save_dir)
        assert client == {"note": "from 4 ranks"} and engine.global_steps == 3
        batches = batches[3:]
    else:
        engine_train(engine, batches[:3], rank=rank, world_size=world_size, micro=MICRO)
        if save:
            engine.save_checkpoint(save_dir, client_state={"note": "from 4 ranks"})
        batches = batches[3:]
    engine_train(engine, batches[:train_steps], rank=rank, world_size=world_size, micro=MICRO)
    with GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()], engine.get_lr()


@pytest.mark.parametrize("saved_stage,resumes", [(2, ((2, 2), (1, 2), (0, 1))), (3, ((2, 2), (3, 2)))])
def test_checkpoint_from_4_ranks_resumes_at_other_stages_and_sizes(tmp_path, saved_stage, resumes):
    save_dir = str(tmp_path / "ckpt")
    straight, lr = run_distributed(
        _phase,
        world_size=4,
        tmp_path=tmp_path,
        stage=saved_stage,
        save_dir=save_dir,
        load=False,
        train_steps=3,
        save=True,
    )[0]
    for stage, world_size in resumes:
        resumed, resumed_lr = run_distributed(
            _phase,
            world_size=world_size,
            tmp_path=tmp_path,
            stage=stage,
            save_dir=save_dir,
            load=True,
            train_steps=3,
            save=False,
        )[0]
        assert resumed_lr == lr
        worst = max((a - b).abs().max().item() for a, b in zip(straight, resumed))
        assert worst < 2e-5, f"stage {stage} on {world_size} ranks: max |diff| {worst}"


def _overflow(rank, world_size):
    engine, _, _, _ = shardwise.initialize(
        model=TinyMLP(seed=1),
        config=_config(2, world_size, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1}),
    )
    tokens, targets = token_batches(num_steps=1, batch=MICRO, seed=rank)[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(tokens, targets)
        engine.backward(loss * float("inf") if rank == 1 else loss)
        engine.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    return unchanged, engine.was_step_applied(), engine.get_loss_scale()


def test_stage2_fp16_overflow_skips_everywhere(tmp_path):
    for unchanged, applied, scale in run_distributed(_overflow, world_size=2, tmp_path=tmp_path):
        assert unchanged and not applied and scale == 2**7


def _stage3_loads(rank, world_size):
    """Stage 3 loads full weights a unit at a time; compare with nn.Module.load_state_dict."""
    config = _config(3, world_size, bf16={"enabled": True})
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 40  # LayerNorm, biases: whole
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=config)
    engine_train(
        engine, token_batches(num_steps=2, batch=GLOBAL_BATCH, seed=2), rank=rank, world_size=world_size, micro=MICRO
    )
    generator = torch.Generator().manual_seed(7)
    full = {k: torch.randn(v.shape, generator=generator) for k, v in TinyMLP(seed=3).state_dict().items()}
    full["head.weight"] = full["embed.weight"]  # tied
    results = {}
    reference = TinyMLP(seed=3).to(torch.bfloat16)
    with GatheredParameters(list(engine.module.parameters())):
        reference.load_state_dict({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    partial = {k: v for k, v in full.items() if k != "fc1.bias"}  # fc1's unit is filled in part
    outcome = engine.strategy.views.load_module_state_dict(partial, strict=False)
    expected = reference.load_state_dict(partial, strict=False)
    results["missing"] = (outcome.missing_keys, expected.missing_keys)
    with GatheredParameters(list(engine.module.parameters())):
        got = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    results["same"] = all(torch.equal(got[k], v) for k, v in reference.state_dict().items())
    # the persistent LayerNorm is whole outside any gather: it must show the loaded values
    results["persistent"] = torch.equal(engine.module.norm.weight.detach(), full["norm.weight"].bfloat16())
    for name, bad in (
        ("missing", partial),
        ("unexpected", {**full, "extra.weight": torch.zeros(2)}),
        ("size", {**full, "fc1.weight": torch.zeros(3, 3)}),
    ):
        try:
            engine.strategy.views.load_module_state_dict(bad, strict=True)
            results[f"error {name}"] = None
        except RuntimeError as exc:
            results[f"error {name}"] = str(exc)
    return results


def test_stage3_loads_weights_a_unit_at_a_time_as_load_state_dict_does(tmp_path):
    for r in run_distributed(_stage3_loads, world_size=2, tmp_path=tmp_path):
        assert r["missing"][0] == r["missing"][1] == ["fc1.bias"], r["missing"]
        assert r["same"] and r["persistent"], r
        assert "fc1.bias" in r["error missing"], r
        assert "extra.weight" in r["error unexpected"], r
        assert "size mismatch for fc1.weight" in r["error size"], r
