"""The 1-bit optimizers switch phase exactly after ``freeze_step`` (0/1 Adam:
``var_freeze_step``) steps, checked by value on every step: whether the gradients stay local
(the engine stops averaging them), whether the variance moves, and how many compressed
exchanges the step makes (recorded in one process, where an exchange is a no-op)."""

import pytest
import torch

from shardwise.optim import OneBitAdam
from shardwise.optim.onebit.lamb import OneBitLamb
from shardwise.optim.onebit.zoadam import ZeroOneAdam

FREEZE, STEPS = 3, 6

OPTIMIZERS = {
    "OneBitAdam": lambda params: OneBitAdam(params, lr=0.1, freeze_step=FREEZE),
    "OneBitLamb": lambda params: OneBitLamb(params, lr=0.1, freeze_step=FREEZE),
    # var_update_scaler large: the variance interval stays 1, so every step up to the freeze updates it
    "ZeroOneAdam": lambda params: ZeroOneAdam(params, lr=0.1, var_freeze_step=FREEZE, var_update_scaler=100),
}


def _phases(optimizer, param):
    """Per step: (gradients left local, variance updated, compressed exchanges)."""
    exchanges = []
    plain = optimizer.compressed_average_

    def counting(tensors, **kwargs):
        exchanges.append(kwargs["tag"])
        plain(tensors, **kwargs)

    optimizer.compressed_average_ = counting
    generator = torch.Generator().manual_seed(1)
    phases = []
    for _ in range(STEPS):
        local = optimizer.averages_gradients_itself()
        param.grad = torch.randn(param.shape, generator=generator)
        variance = optimizer.state[param].get("exp_avg_sq", torch.zeros(())).clone()
        exchanges.clear()
        optimizer.step()
        moved = not torch.equal(optimizer.state[param]["exp_avg_sq"], variance)
        phases.append((local, moved, len(exchanges)))
    return phases


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_compressed_phase_starts_exactly_after_the_freeze_step(name):
    param = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    phases = _phases(OPTIMIZERS[name]([param]), param)
    warm_up, compressed = phases[:FREEZE], phases[FREEZE:]
    assert warm_up == [(False, True, 0)] * FREEZE, phases
    assert compressed == [(True, False, 1)] * (STEPS - FREEZE), phases
