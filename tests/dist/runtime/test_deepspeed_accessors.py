"""DeepSpeed's engine accessors and adjusters on 2 ranks: batch sizes changed mid-run,
settings read back, and module weights loaded at stage 3 (partitioned) as DeepSpeed's
load_module_state_dict does."""

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL


def _accessors(rank, world_size):
    engine, _, _, _ = shardwise.initialize(
        model=TinyMLP(seed=1),
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, **STAGE3_PARTITION_ALL},
        },
    )
    out = {
        "info": engine.get_batch_info(),
        "zero": (
            engine.zero_optimization(),
            engine.zero_optimization_partition_gradients(),
            engine.zero_optimization_partition_weights(),
        ),
        "dtype": engine.communication_data_type,
        "name": engine.optimizer_name(),
        "print": engine.steps_per_print(),
        "scale": engine.loss_scale(),
        "dynamic": engine.dynamic_loss_scale(),
        "offload": engine.zero_offload_optimizer().device,
        "config": engine.config["train_micro_batch_size_per_gpu"],
    }
    with pytest.raises(ValueError, match="must be divisible by micro-batch size x data-parallel size = 4"):
        engine.set_train_batch_size(6)
    engine.set_train_batch_size(8)  # two micro-batches per step now
    out["after_batch"] = engine.get_batch_info()
    tokens, targets = token_batches(num_steps=1, batch=2, seed=rank)[0]
    steps = []
    for _ in range(4):
        engine.backward(engine(tokens, targets))
        engine.step()
        steps.append(engine.global_steps)
    out["steps"] = steps
    with pytest.raises(ValueError, match="device='nvme'.* is not supported; offload to 'cpu'"):
        engine.offload_states(device="nvme")
    with pytest.raises(ValueError, match="not trained by a shardwise engine"):
        shardwise.utils.safe_set_full_fp32_param(torch.nn.Parameter(torch.zeros(2)), torch.ones(2))
    engine.set_train_micro_batch_size(1)
    out["after_micro"] = engine.get_batch_info()

    # load_module_state_dict: full weights into the partitioned model; returns None
    source = TinyMLP(seed=7)
    out["returned"] = engine.load_module_state_dict({"module": source.state_dict()})
    with shardwise.zero.GatheredParameters(list(engine.module.parameters())):
        out["loaded"] = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), source.parameters()))
    # custom_load_fn copies inside GatheredParameters; the masters follow
    other = TinyMLP(seed=8)

    def copy_in(src, dst):
        with torch.no_grad():
            for name, p in dst.named_parameters():
                p.copy_(src[name])

    engine.load_module_state_dict({"module": other.state_dict()}, custom_load_fn=copy_in, fetch_z3_params=True)
    out["custom"] = all(
        torch.equal(shardwise.utils.safe_get_full_fp32_param(p), other.get_parameter(n))
        for n, p in engine.module.named_parameters()
    )
    ids = [getattr(p, "ds_id", None) for p in engine.module.parameters()]  # DeepSpeed-Chat's stage-3 test
    out["ds_ids"] = (len(ids), len(set(ids)), all(isinstance(i, int) for i in ids))
    params = list(engine.module.parameters())  # DeepSpeed-Chat's perf.py counts the full size by ds_tensor
    out["counted"] = sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in params)
    out["pieces"] = [p.ds_tensor.clone() for p in params]
    out["full"] = [shardwise.utils.safe_get_full_fp32_param(p).reshape(-1) for p in params]
    timer = engine.tput_timer  # DeepSpeed-Chat calls update_epoch_count() after each epoch
    timer.update_epoch_count()
    engine.backward(engine(*token_batches(num_steps=1, batch=1, seed=rank)[0]))
    engine.step()
    out["tput"] = (timer.epoch_count, timer.micro_step_count, timer.global_step_count)
    return out


def test_deepspeed_accessors_and_load_module_state_dict(tmp_path):
    results = run_distributed(_accessors, world_size=2, tmp_path=tmp_path)
    for r in results:
        assert r["info"] == (4, 2, 1) and r["zero"] == (True, True, True)
        assert r["dtype"] == torch.float32 and r["name"] == "adamw" and r["print"] == 1000
        assert r["scale"] == 0.0 and r["dynamic"] and r["offload"] == "none" and r["config"] == 2
        assert r["after_batch"] == (8, 2, 2) and r["steps"] == [0, 1, 1, 2]
        count, distinct, ints = r["ds_ids"]
        assert count == distinct == 7 and ints, r["ds_ids"]
        assert r["counted"] == sum(f.numel() for f in r["full"])
    for piece0, piece1, full in zip(results[0]["pieces"], results[1]["pieces"], results[0]["full"]):
        assert torch.equal(torch.cat([piece0, piece1]), full)  # each rank's piece of the parameter
    for r in results:
        assert r["tput"] == (1, 1, 2), r["tput"]  # 4 micro-steps at 2 per step, then one more
        assert r["after_micro"] == (4, 1, 2)
        assert r["returned"] is None and r["loaded"] and r["custom"]
