"""Accelerate's DeepSpeed integration (``Accelerator(deepspeed_plugin=...)``) runs on
shardwise through ``shardwise.install_as_deepspeed()``, and matches plain PyTorch.

fp32 on the CPU: 1e-5 relative on losses and 1e-3 on weights (Adam divides near-zero
gradients by their own size, so rounding differences show there), below one AdamW step
at lr 1e-2 (~1e-2 per weight).
"""

import importlib.util
import os

import pytest
import torch

import shardwise
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")
# not imported here: Accelerate must first be imported after install_as_deepspeed()
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")

MICRO, STEPS, LR = 2, 4, 1e-2


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(config)


def _accelerate_job(rank, world_size, stage):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    shardwise.install_as_deepspeed()  # before Accelerate is imported
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    ids = torch.randint(0, 64, (MICRO * world_size * STEPS, 16), generator=torch.Generator().manual_seed(1))
    reference = _model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    reference_losses = []
    for step in range(STEPS):
        batch = ids[step * MICRO * world_size : (step + 1) * MICRO * world_size]
        loss = reference(input_ids=batch, labels=batch).loss
        reference_losses.append(loss.item())
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    # On a machine without accelerators Accelerate picks no backend for DeepSpeed: name gloo
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]
    )
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(ids, batch_size=MICRO)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    checks = {
        "distributed_type": accelerator.distributed_type == DistributedType.DEEPSPEED,
        "processes": accelerator.num_processes,
        "engine": isinstance(engine, shardwise.DeepSpeedEngine),
        "unwrapped": accelerator.unwrap_model(engine) is model,
    }
    losses = []
    for batch in loader:
        loss = engine(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    checks["skipped"] = optimizer.step_was_skipped
    checks["steps"] = engine.global_steps
    state = accelerator.get_state_dict(engine)
    if rank == 0:
        checks["weights"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return reference_losses, losses, checks


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerator_with_deepspeed_plugin_matches_pytorch(tmp_path, stage):
    results = run_distributed(
        _accelerate_job, world_size=2, tmp_path=tmp_path, timeout_s=180, stage=stage, fresh_processes=True
    )
    for reference_losses, losses, checks in results:
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert checks["distributed_type"] and checks["engine"] and checks["unwrapped"]
        assert checks["processes"] == 2 and checks["steps"] == STEPS and checks["skipped"] is False
    assert results[0][2]["weights"] < 1e-3


_LAUNCH = (
    "import sys, shardwise; shardwise.install_as_deepspeed(); "
    "from accelerate.commands.launch import main; sys.exit(main())"
)
"""``accelerate launch`` with the alias installed in the launcher process (which checks
that DeepSpeed is installed); the launched script installs it again for itself."""

_SCRIPT = """
import shardwise
shardwise.install_as_deepspeed()
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x in loader:
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
line = f"{accelerator.num_processes} {type(model).__name__} {model.zero_optimization_stage()} {model.global_steps}"
open(f"result{accelerator.process_index}", "w").write(line)
"""


def test_accelerate_launch_use_deepspeed(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _LAUNCH,
            "--use_deepspeed",
            "--zero_stage",
            "2",
            "--num_processes",
            "2",
            "--gradient_accumulation_steps",
            "1",
            "--mixed_precision",
            "no",
            "--main_process_port",
            "0",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(tmp_path / f"result{rank}").read_text() for rank in (0, 1)] == ["2 Engine 2 2"] * 2
