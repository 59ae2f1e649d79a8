from types import SimpleNamespace

import pytest
import torch

from shardwise.optim import Lamb, build_optimizer


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def _build(name, params=None, **options):
    return build_optimizer(SimpleNamespace(type=name, params=options), params or _params())


# DeepSpeed's engine: type AdamW is always decoupled; type Adam is decoupled unless
# adam_w_mode is false; torch_adam picks torch's class (and so torch's weight-decay default).
@pytest.mark.parametrize(
    "name,options,cls,weight_decay",
    [
        ("adam", {}, torch.optim.AdamW, 0.0),
        ("adam", {"adam_w_mode": True}, torch.optim.AdamW, 0.0),
        ("adam", {"adam_w_mode": False}, torch.optim.Adam, 0.0),
        ("adam", {"torch_adam": True}, torch.optim.AdamW, 0.01),
        ("adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, 0.0),
        ("adamw", {}, torch.optim.AdamW, 0.0),
        ("adamw", {"adam_w_mode": False}, torch.optim.AdamW, 0.0),
        ("adamw", {"torch_adam": True}, torch.optim.AdamW, 0.01),
        ("adam", {"weight_decay": 0.1}, torch.optim.AdamW, 0.1),
    ],
)
def test_adam_variants_follow_deepspeed(name, options, cls, weight_decay):
    opt = _build(name, **options)
    assert type(opt) is cls
    assert opt.param_groups[0]["weight_decay"] == weight_decay


def test_parameters_are_mapped():
    group = _build(
        "adam",
        lr=0.01,
        betas=[0.8, 0.95],
        eps=1e-6,
        weight_decay=0.1,
        amsgrad=True,
        bias_correction=True,
        set_grad_none=True,
    ).param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["amsgrad"]) == (
        0.01,
        (0.8, 0.95),
        1e-6,
        0.1,
        True,
    )
    group = _build("sgd", lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False).param_groups[0]
    assert (group["lr"], group["momentum"], group["dampening"], group["weight_decay"]) == (0.1, 0.9, 0.1, 0.01)
    group = _build(
        "adagrad", lr=0.1, eps=1e-8, weight_decay=0.01, lr_decay=0.5, initial_accumulator_value=0.2
    ).param_groups[0]
    assert (group["lr"], group["eps"], group["lr_decay"], group["initial_accumulator_value"]) == (0.1, 1e-8, 0.5, 0.2)
    lamb = _build("lamb", lr=0.01, betas=[0.8, 0.9], max_coeff=5.0, min_coeff=0.1, eps_inside_sqrt=True)
    assert isinstance(lamb, Lamb)
    assert (lamb.defaults["betas"], lamb.defaults["max_coeff"], lamb.defaults["eps_inside_sqrt"]) == (
        (0.8, 0.9),
        5.0,
        True,
    )


@pytest.mark.parametrize(
    "name,cls,lr",
    [
        ("adam", torch.optim.AdamW, 1e-3),
        ("adamw", torch.optim.AdamW, 1e-3),
        ("sgd", torch.optim.SGD, 1e-3),
        ("adagrad", torch.optim.Adagrad, 1e-2),
        ("lamb", Lamb, 1e-3),
    ],
)
def test_missing_and_auto_values_take_the_optimizers_defaults(name, cls, lr):
    for opt in (_build(name), _build(name, lr="auto", weight_decay="auto")):
        assert type(opt) is cls
        assert opt.param_groups[0]["lr"] == lr


def test_cpu_tensors_use_the_fused_kernels_unless_told_otherwise():
    for name in ("adam", "adamw", "sgd", "adagrad"):
        assert _build(name).param_groups[0]["fused"] is True
    group = _build("adamw", foreach=False).param_groups[0]
    assert group["foreach"] is False and not group["fused"]
    assert _build("adamw", differentiable=True).param_groups[0]["foreach"] is None


def test_unknown_parameter_names_the_closest_match_and_the_allowed_keys():
    with pytest.raises(
        ValueError,
        match=r"optimizer 'adamw' has no parameter 'weight_decy'; did you mean "
        r"'weight_decay'\? \(allowed: adam_w_mode, amsgrad, betas",
    ):
        _build("adamw", weight_decy=0.1)
    with pytest.raises(ValueError, match="optimizer 'sgd' has no parameter 'betas'"):
        _build("sgd", betas=[0.9, 0.99])
    with pytest.raises(ValueError, match="optimizer 'lamb' has no parameter 'max_cof'; did you mean 'max_coeff'"):
        _build("lamb", max_cof=1.0)


def test_refusals():
    with pytest.raises(ValueError, match="gradient_clipping"):
        _build("lamb", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="bias_correction=false"):
        _build("adam", bias_correction=False)
    with pytest.raises(ValueError, match="unknown optimizer 'adamx'; did you mean 'adam"):
        _build("adamx")
    with pytest.raises(ValueError, match="amsgrad"):
        _build("lamb", amsgrad=True)


def test_param_groups_and_named_parameters_pass_through():
    groups = [{"params": _params(), "weight_decay": 0.1}, {"params": _params(), "lr": 0.5}]
    opt = build_optimizer(SimpleNamespace(type="adamw", params={"lr": 0.01}), iter(groups))
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    named = build_optimizer(SimpleNamespace(type="sgd", params={"lr": 0.1}), torch.nn.Linear(2, 2).named_parameters())
    assert len(named.param_groups[0]["params"]) == 2


def test_built_optimizers_step():
    for name in ("adam", "adamw", "sgd", "adagrad", "lamb"):
        p = torch.nn.Parameter(torch.ones(3))
        opt = _build(name, params=[p], lr=0.1)
        (p**2).sum().backward()
        opt.step()
        assert (p.detach() < 1).all(), name
