"""shardwise.ops.adam takes DeepSpeed's constructor arguments and steps as torch's Adam/AdamW."""

import pytest
import torch

import shardwise as deepspeed  # the one-import switch these classes exist for


def _run(make, steps=3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(5))]
    optimizer = make(params)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        optimizer.step()
    return optimizer, [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", ["DeepSpeedCPUAdam", "FusedAdam"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_steps_like_torch_adam_on_the_fused_cpu_kernel(name, decoupled):
    cls = getattr(deepspeed.ops.adam, name)
    mode = {"adamw_mode" if name == "DeepSpeedCPUAdam" else "adam_w_mode": decoupled}
    ours, got = _run(lambda p: cls(p, lr=0.01, betas=[0.8, 0.99], eps=1e-6, weight_decay=0.1, **mode))
    reference = torch.optim.AdamW if decoupled else torch.optim.Adam
    _, expected = _run(lambda p: reference(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1))
    assert ours.defaults["fused"] is True and ours.defaults["decoupled_weight_decay"] is decoupled
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))


def test_unsupported_arguments_are_clear_errors():
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match=r"DeepSpeedCPUAdam\(bias_correction=False\) is not supported"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(params, bias_correction=False)
    with pytest.raises(ValueError, match=r"fp32_optimizer_states=False\) is not supported"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(params, fp32_optimizer_states=False)
    with pytest.raises(ValueError, match=r"FusedAdam\(bias_correction=False\) is not supported"):
        deepspeed.ops.adam.FusedAdam(iter(params), bias_correction=False)
