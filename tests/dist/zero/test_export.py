"""A checkpoint from any stage and world size consolidates into one plain state dict."""

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise.checkpoint import consolidate
from shardwise.cli import main as cli_main
from shardwise.testing import run_distributed
from shardwise.testing.models import TinyMLP, token_batches
from shardwise.testing.parity import STAGE3_PARTITION_ALL, engine_train


def _train_and_save(rank, world_size, save_dir, stage, dtype):
    config = {
        "gradient_clipping": 0.0,
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, **STAGE3_PARTITION_ALL},
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine, _, _, _ = shardwise.initialize(model=TinyMLP(seed=1), config=config)
    engine_train(engine, token_batches(num_steps=3, batch=8, seed=4), rank=rank, world_size=world_size, micro=2)
    engine.save_checkpoint(save_dir)
    engine.save_16bit_model(save_dir, "model16.safetensors")
    engine.save_16bit_model(save_dir)
    tokens, targets = token_batches(num_steps=1, batch=4, seed=9)[0]
    with torch.no_grad():
        loss = engine(tokens, targets).item()
    module_state = engine.strategy.views.module_state_dict()
    master = None
    if dtype != "fp32":  # the fp32 weights the optimizer holds, gathered per parameter name
        master = engine.strategy.views.optimizer_state_by_name()["master"]
    return loss, {k: v.detach().clone() for k, v in module_state.items()}, master


@pytest.mark.parametrize("stage,dtype", [(2, "fp32"), (2, "bf16"), (0, "fp16"), (3, "fp32"), (3, "bf16")])
def test_consolidate_any_checkpoint(tmp_path, stage, dtype):
    save_dir = tmp_path / "ckpt"
    loss, module_state, master = run_distributed(
        _train_and_save, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir), stage=stage, dtype=dtype
    )[0]
    state = consolidate(save_dir)
    assert set(state) == set(module_state)
    assert all(v.dtype == torch.float32 for v in state.values())
    if dtype == "fp32":
        plain = TinyMLP(seed=5)
        plain.load_state_dict(state)
        tokens, targets = token_batches(num_steps=1, batch=4, seed=9)[0]
        with torch.no_grad():
            assert plain(tokens, targets).item() == loss  # identical outputs
    else:
        for name, value in master.items():
            assert torch.equal(state[name], value)  # full precision, not the 16-bit copy
        assert torch.equal(state["head.weight"], state["embed.weight"])  # tied weights agree
        assert any(not torch.equal(state[k], module_state[k].float()) for k in master)
    # the 16-bit model file holds the module's weights in their training dtype
    sixteen = load_file(str(save_dir / "model16.safetensors"))
    assert all(torch.equal(sixteen[k], module_state[k]) for k in module_state)
    assert (save_dir / "pytorch_model.bin").is_file()


def test_convert_command(tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    run_distributed(_train_and_save, world_size=2, tmp_path=tmp_path, save_dir=str(save_dir), stage=2, dtype="bf16")
    out = tmp_path / "full.safetensors"
    assert cli_main(["convert", str(save_dir), str(out), "--dtype", "bf16"]) == 0
    converted = load_file(str(out))
    expected = consolidate(save_dir, dtype=torch.bfloat16)
    assert set(converted) == set(expected) and all(torch.equal(converted[k], expected[k]) for k in expected)
    assert cli_main(["convert", str(tmp_path / "nothing"), str(out)]) == 2
    assert "shardwise convert:" in capsys.readouterr().err
