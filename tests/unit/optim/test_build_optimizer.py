from types import SimpleNamespace

import pytest
import torch

from shardwise.optim import Lamb, build_optimizer


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def _build(name, **params):
    return build_optimizer(SimpleNamespace(type=name, params=params), _params())


def test_adam_decouples_weight_decay_like_deepspeed():
    assert type(_build("adam", lr=0.1)) is torch.optim.AdamW
    assert type(_build("adam", lr=0.1, adam_w_mode=False)) is torch.optim.Adam
    assert type(_build("adam", lr=0.1, torch_adam=True)) is torch.optim.Adam
    assert type(_build("adamw")) is torch.optim.AdamW


def test_defaults_and_fast_path():
    opt = _build("adamw")
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.0 and group["betas"] == (0.9, 0.999)
    assert group["foreach"] is True  # CPU tensors: multi-tensor kernels
    assert _build("sgd", lr=0.1, momentum=0.9).param_groups[0]["momentum"] == 0.9
    assert type(_build("adagrad")) is torch.optim.Adagrad
    assert isinstance(_build("lamb", lr=0.01), Lamb)


def test_unknown_parameter_suggests_closest():
    with pytest.raises(ValueError, match="optimizer 'adamw' has no parameter 'weight_decy'; did you mean "
                                         "'weight_decay'"):
        _build("adamw", weight_decy=0.1)


def test_auto_values_take_the_default():
    assert _build("adamw", lr="auto").param_groups[0]["lr"] == 1e-3


def test_param_groups_pass_through():
    groups = [{"params": _params(), "weight_decay": 0.1}, {"params": _params(), "lr": 0.5}]
    opt = build_optimizer(SimpleNamespace(type="adamw", params={"lr": 0.01}), groups)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
