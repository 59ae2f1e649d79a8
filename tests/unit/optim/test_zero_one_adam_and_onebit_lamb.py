"""0/1 Adam and 1-bit LAMB in one process: their arguments, 0/1 Adam's schedule step by
step (which steps ask for averaged gradients, when the intervals double, what is frozen),
its warm-up against torch's AdamW, a resume from ``state_dict``, and 1-bit LAMB's warm-up
against :class:`shardwise.optim.Lamb`. With one rank the compressed exchanges return
their input, so only the arithmetic around them is checked here; the exchanges are
checked in ``tests/dist/optim/test_zero_one_adam_and_onebit_lamb_dist.py``."""

import copy
import re

import pytest
import torch

from shardwise.config import load_config
from shardwise.optim import Lamb, OneBitLamb, ZeroOneAdam, build_optimizer
from shardwise.runtime.fp16.onebit.lamb import OnebitLamb
from shardwise.runtime.fp16.onebit.zoadam import ZeroOneAdam as AliasedZeroOneAdam


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=generator)),
        torch.nn.Parameter(torch.randn(3, generator=generator)),
    ]


def _set_grads(params, generator):
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def test_deepspeed_names_and_defaults():
    assert OnebitLamb is OneBitLamb and AliasedZeroOneAdam is ZeroOneAdam
    zo = ZeroOneAdam(_params())
    assert (zo.var_freeze_step, zo.var_update_scaler, zo.local_step_scaler, zo.local_step_clipper) == (
        100000,
        16,
        32678,
        16,
    )
    assert zo.defaults["lr"] == 1e-3 and zo.defaults["bias_correction"] and not zo.averages_gradients_itself()
    lamb = OneBitLamb(_params())
    assert lamb.freeze_step == 100000 and (
        lamb.coeff_beta,
        lamb.factor_max,
        lamb.factor_min,
        lamb.factor_threshold,
    ) == (0.9, 4.0, 0.5, 0.1)
    assert lamb.defaults["max_coeff"] == 10.0 and lamb.defaults["min_coeff"] == 0.01
    assert not lamb.averages_gradients_itself()


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (ZeroOneAdam, {"var_freeze_step": 0}, "var_freeze_step must be an integer >= 1"),
        (ZeroOneAdam, {"var_freeze_step": -3}, "var_freeze_step must be an integer >= 1"),
        (ZeroOneAdam, {"var_update_scaler": 0}, "var_update_scaler must be an integer >= 1"),
        (ZeroOneAdam, {"local_step_scaler": 0}, "local_step_scaler must be an integer >= 1"),
        (ZeroOneAdam, {"local_step_clipper": 0}, "local_step_clipper must be an integer >= 1"),
        (ZeroOneAdam, {"amsgrad": True}, "amsgrad"),
        (ZeroOneAdam, {"comm_backend_name": "gloo2"}, "comm_backend_name 'gloo2' is not one of"),
        (ZeroOneAdam, {"max_grad_norm": 1.0}, "gradient_clipping"),
        (ZeroOneAdam, {"betas": (0.9, 1.0)}, "betas in [0, 1)"),
        (OneBitLamb, {"freeze_step": 0}, "freeze_step must be an integer >= 1"),
        (OneBitLamb, {"amsgrad": True}, "amsgrad"),
        (OneBitLamb, {"comm_backend_name": "gloo2"}, "comm_backend_name 'gloo2' is not one of"),
        (OneBitLamb, {"max_grad_norm": 1.0}, "gradient_clipping"),
        (OneBitLamb, {"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff <= max_coeff"),
        (OneBitLamb, {"coeff_beta": 1.0}, "coeff_beta must be in [0, 1)"),
        (OneBitLamb, {"factor_min": 0.0}, "0 < factor_min <= factor_max"),
        (OneBitLamb, {"factor_threshold": -0.1}, "factor_threshold >= 0"),
    ],
)
def test_bad_arguments(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(_params(), **kwargs)


@pytest.mark.parametrize("backend", ["nccl", "mpi", "hccl", "compressed"])
def test_deepspeeds_backend_names_are_accepted(backend):
    for cls in (ZeroOneAdam, OneBitLamb):
        opt = cls(_params(), comm_backend_name=backend, cuda_aware=True)
        assert (opt.comm_backend_name, opt.cuda_aware) == (backend, True), cls.__name__
        config = load_config(
            world_size=1,
            config={
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": cls.__name__, "params": {"comm_backend_name": backend, "cuda_aware": True}},
            },
        )
        built = build_optimizer(config.optimizer, _params())
        assert (type(built), built.comm_backend_name, built.cuda_aware) == (cls, backend, True)


def test_config_builds_them():
    config = load_config(
        world_size=1,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "ZeroOneAdam",
                "params": {
                    "lr": 1e-3,
                    "var_freeze_step": 7,
                    "var_update_scaler": 2,
                    "local_step_scaler": 3,
                    "local_step_clipper": 4,
                },
            },
        },
    )
    opt = build_optimizer(config.optimizer, _params())
    assert isinstance(opt, ZeroOneAdam) and (opt.var_freeze_step, opt.local_step_clipper) == (7, 4)
    config = load_config(
        world_size=1,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "OneBitLamb",
                "params": {"freeze_step": 5, "coeff_beta": 0.8, "factor_threshold": 0.2},
            },
        },
    )
    opt = build_optimizer(config.optimizer, _params())
    assert isinstance(opt, OneBitLamb) and (opt.freeze_step, opt.coeff_beta, opt.factor_threshold) == (5, 0.8, 0.2)


# -- 0/1 Adam's schedule ------------------------------------------------------------------------

# var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4:
# "var": variance step on gradients the engine averaged; "grad": gradients averaged
# compressed inside step(); "local": no communication; "sync": local, then the exchange.
SCHEDULE = (
    ["var", "var", "grad", "var", "grad", "var"]  # var_interval 1, 1, 2, 2, 2, 2 -> 4
    + ["sync", "sync"]  # local_step_interval 1 (doubles after 2 frozen steps)
    + ["local", "sync"] * 2  # 2 (doubles after step 10) -> 4
    + ["local", "local", "local", "sync"] * 3
)  # 4 = the clipper
VAR_INTERVALS = [1, 2, 2, 2, 2, 4] + [4] * 18  # after each step
LOCAL_INTERVALS = [1] * 6 + [1, 2, 2, 4] + [4] * 14


def _zero_one_adam(params, **kwargs):
    return ZeroOneAdam(
        params, lr=0.05, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4, **kwargs
    )


def test_zero_one_adam_schedule_step_by_step():
    params = _params()
    opt = _zero_one_adam(params, weight_decay=0.1)
    generator = torch.Generator().manual_seed(3)
    for step, kind in enumerate(SCHEDULE, start=1):
        assert opt.averages_gradients_itself() == (kind != "var"), f"step {step} ({kind})"
        state = opt.state[params[0]]
        variance = state["exp_avg_sq"].clone() if state else None
        anchor = state["param_at_sync"].clone() if "param_at_sync" in state else None
        _set_grads(params, generator)
        opt.step()
        assert opt.steps_taken() == step
        assert state["var_interval"] == VAR_INTERVALS[step - 1], f"step {step}"
        assert state["local_step_interval"] == LOCAL_INTERVALS[step - 1], f"step {step}"
        if variance is not None:
            changed = not torch.equal(variance, state["exp_avg_sq"])
            assert changed == (kind == "var"), f"step {step}: the variance {'moved' if changed else 'stayed'}"
        if kind == "local":
            assert torch.equal(anchor, state["param_at_sync"]) and state["lrs"] > 0
        if kind == "sync":
            assert torch.equal(state["param_at_sync"], params[0]) and state["lrs"] == 0.0
    assert state["var_updates"] == SCHEDULE.count("var")
    # every parameter carries the same schedule
    other = opt.state[params[1]]
    assert {k: other[k] for k in ("var_interval", "local_step_interval", "var_updates")} == {
        k: state[k] for k in ("var_interval", "local_step_interval", "var_updates")
    }


def test_zero_one_adam_is_adamw_while_every_step_updates_the_variance():
    ours, theirs = _params(), _params()
    opt = ZeroOneAdam(ours, lr=0.1, weight_decay=0.1, var_freeze_step=50, var_update_scaler=100)
    ref = torch.optim.AdamW(theirs, lr=0.1, weight_decay=0.1, foreach=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        _set_grads(ours, generator)
        for a, b in zip(ours, theirs):
            b.grad = a.grad.clone()
        assert not opt.averages_gradients_itself()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_zero_one_adam_sync_with_one_rank_keeps_the_local_parameter():
    """With one rank the exchange is exact, so a synchronisation re-applies what the local
    steps did (to rounding) and resets the momentum to their lr-weighted mean."""
    assert SCHEDULE[10:12] == ["local", "sync"]
    params = _params()
    opt = _zero_one_adam(params)
    beta1, lr = 0.9, 0.05
    generator = torch.Generator().manual_seed(4)
    for _ in range(11):
        _set_grads(params, generator)
        opt.step()
    state = opt.state[params[0]]
    m11 = state["exp_avg"].clone()
    denom = (state["exp_avg_sq"].sqrt() / (1 - 0.999 ** state["var_updates"]) ** 0.5).add_(1e-8)
    _set_grads(params, generator)
    m12 = m11.lerp(params[0].grad, 1 - beta1)
    c11, c12 = 1 - beta1**11, 1 - beta1**12
    local = params[0].detach() - lr * m12 / c12 / denom
    opt.step()
    torch.testing.assert_close(params[0].detach(), local, rtol=0, atol=1e-6)
    mean = (m11 / c11 + m12 / c12) / 2
    torch.testing.assert_close(state["exp_avg"], c12 * mean, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(state["exp_avg"], m12, rtol=1e-3, atol=0)


def test_zero_one_adam_resumes_from_its_state_dict():
    params, generator = _params(), torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(len(SCHEDULE))]
    for resume_at in (2, 6, 9):
        straight, copy_params = _params(), _params()
        a = _zero_one_adam(straight)
        for g in grads[:resume_at]:
            for p, gi in zip(straight, g):
                p.grad = gi.clone()
            a.step()
        b = _zero_one_adam(copy_params)
        with torch.no_grad():
            for p, q in zip(copy_params, straight):
                p.copy_(q)
        b.load_state_dict(copy.deepcopy(a.state_dict()))  # as if saved: no shared tensors
        for step, g in enumerate(grads[resume_at:], start=resume_at + 1):
            assert a.averages_gradients_itself() == b.averages_gradients_itself() == (SCHEDULE[step - 1] != "var")
            for p, q, gi in zip(straight, copy_params, g):
                p.grad, q.grad = gi.clone(), gi.clone()
            a.step()
            b.step()
        for p, q in zip(straight, copy_params):
            assert torch.equal(p, q), f"resumed after step {resume_at}"


# -- 1-bit LAMB ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"weight_decay": 0.0},
        {"weight_decay": 0.1, "eps_inside_sqrt": True},
        {"weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.5},
    ],
)
def test_onebit_lamb_warm_up_is_lamb(options):
    ours, theirs = _params(), _params()
    opt = OneBitLamb(ours, lr=0.05, freeze_step=10, **options)
    ref = Lamb(theirs, lr=0.05, **options)
    generator = torch.Generator().manual_seed(2)
    for _ in range(6):
        _set_grads(ours, generator)
        for a, b in zip(ours, theirs):
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert not opt.averages_gradients_itself()


def test_onebit_lamb_freezes_variance_and_trust_ratio():
    params = _params()
    opt = OneBitLamb(params, lr=0.05, freeze_step=3, coeff_beta=0.5, factor_threshold=0.1)
    generator = torch.Generator().manual_seed(6)
    warm_up = []
    for step in range(1, 9):
        assert opt.averages_gradients_itself() == (step > 3)
        _set_grads(params, generator)
        opt.step()
        coeffs = opt.get_lamb_coeffs()
        assert len(coeffs) == len(params)
        if step <= 3:
            warm_up.append(coeffs)
        if step == 3:
            variance = opt.state[params[0]]["exp_avg_sq"].clone()
    state = opt.state[params[0]]
    assert torch.equal(state["exp_avg_sq"], variance)
    assert not torch.equal(state["exp_avg_sq_fresh"], variance)
    # the frozen ratio: the moving average of the warm-up's ratios, corrected for its zero start
    expected = 0.0
    for ratios in warm_up:
        expected = 0.5 * expected + 0.5 * ratios[0]
    assert float(state["lamb_coeff_freeze"]) == pytest.approx(expected, rel=1e-6)
    frozen = expected / (1 - 0.5**3)
    # five compressed steps: the factor moved at most 10% a step from 1
    factor = float(state["last_factor"])
    assert 0.9**5 - 1e-6 <= factor <= 1.1**5 + 1e-6
    assert opt.get_lamb_coeffs()[0] == pytest.approx(frozen * factor, rel=1e-6)
    assert all(torch.isfinite(p).all() for p in params)
