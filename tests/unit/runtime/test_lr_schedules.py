import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from shardwise.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def _optimizer(groups=1, lr=0.1, cls=torch.optim.AdamW, **kwargs):
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return cls(params, lr=lr, **kwargs)


def _trace(scheduler, last_iteration, key="lr", group=0):
    """{iteration: value in the optimizer} from the scheduler's current iteration on."""
    out = {scheduler.last_batch_iteration: scheduler.optimizer.param_groups[group][key]}
    while scheduler.last_batch_iteration < last_iteration:
        scheduler.step()
        out[scheduler.last_batch_iteration] = scheduler.optimizer.param_groups[group][key]
    return out


def test_warmup_lr_log():
    opt = _optimizer()
    lr = _trace(WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), 12)
    assert lr[-1] == 0.0 and lr[0] == 0.0  # the first two steps share the minimum
    assert lr[1] == pytest.approx(math.log(2) / math.log(10))
    assert lr[5] == pytest.approx(math.log(6) / math.log(10))
    assert lr[9] == pytest.approx(1.0)  # log(10) / log(10)
    assert lr[10] == lr[12] == 1.0  # held after the warm-up


def test_warmup_lr_linear():
    s = WarmupLR(_optimizer(), warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    lr = _trace(s, 6)
    assert [lr[i] for i in range(-1, 7)] == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5])


def test_warmup_lr_max_defaults_to_the_first_groups_lr():
    opt = torch.optim.AdamW(
        [
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3},
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.7},
        ]
    )
    s = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    s.step(5)
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.3]  # as DeepSpeed: group 0's lr for all
    assert WarmupDecayLR(_optimizer(), total_num_steps=10).max_lrs == [0.001]


def test_warmup_num_steps_is_validated_and_at_least_two():
    assert WarmupLR(_optimizer(), warmup_num_steps=1).warmup_num_steps == 2
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
            WarmupLR(_optimizer(), warmup_num_steps=bad)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear'"):
        WarmupLR(_optimizer(), warmup_type="cosine")


def test_warmup_decay_reaches_zero_at_total_steps():
    s = WarmupDecayLR(_optimizer(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear")
    lr = _trace(s, 14)
    assert [lr[i] for i in range(-1, 3)] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert lr[3] == pytest.approx(7 / 8)  # (10 - 3) / (10 - 2)
    assert lr[9] == pytest.approx(1 / 8)
    assert lr[10] == 0.0 and lr[14] == 0.0  # 0 at total_num_steps, never negative


def test_warmup_decay_warns_when_total_is_below_warmup(caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        WarmupDecayLR(_optimizer(), total_num_steps=5, warmup_num_steps=10)
    assert "less than warmup_num_steps" in caplog.text


def test_warmup_cosine_is_a_ratio_of_the_optimizers_lr():
    s = WarmupCosineLR(
        _optimizer(lr=0.2),
        total_num_steps=12,
        warmup_min_ratio=0.1,
        warmup_num_steps=2,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    lr = _trace(s, 20)

    def cosine(progress):
        return 0.2 * (0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2)

    assert lr[-1] == 0.0  # DeepSpeed's value before the start
    assert lr[0] == pytest.approx(0.2 * 0.1)  # warmup_min_ratio x lr
    assert lr[1] == pytest.approx(0.2 * 0.55)  # 0.1 + 0.9 * 1 / 2
    assert lr[2] == pytest.approx(cosine(1 / 10))  # first decay step: (2 - 2 + 1) / (12 - 2)
    assert lr[6] == pytest.approx(cosine(0.5)) == pytest.approx(0.2 * 0.505)
    assert lr[11] == pytest.approx(0.2 * 0.01)  # the floor at total - 1 ...
    assert lr[20] == pytest.approx(0.2 * 0.01)  # ... and after it (no rise again)


def test_warmup_cosine_log_warmup_and_groups():
    opt = torch.optim.AdamW(
        [
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0},
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5},
        ]
    )
    s = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    s.step(4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(
        [math.log(5) / math.log(10), 0.5 * math.log(5) / math.log(10)]
    )
    s.step(9)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.5])


def test_one_cycle_lr_momentum_and_decay():
    opt = _optimizer(lr=1.0, betas=(0.9, 0.999))
    s = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.1,
        cycle_first_step_size=5,
        decay_lr_rate=1.0,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)  # DeepSpeed's values at construction
    lr = _trace(s, 12)
    betas = {}
    s2 = OneCycle(
        _optimizer(),
        cycle_min_lr=0.1,
        cycle_max_lr=1.1,
        cycle_first_step_size=5,
        decay_lr_rate=1.0,
        decay_step_size=2,
        decay_mom_rate=0.1,
    )
    for it in range(13):
        s2.step()
        betas[it] = s2.optimizer.param_groups[0]["betas"]
    assert lr[-1] == pytest.approx(0.1)
    assert lr[0] == pytest.approx(0.3) and betas[0] == pytest.approx((0.88, 0.99))  # (it + 1) / 5 up
    assert lr[4] == pytest.approx(1.1) and betas[4] == pytest.approx((0.8, 0.99))  # the peak
    assert lr[8] == pytest.approx(0.3)  # 1 / 5 on the way down
    assert lr[9] == pytest.approx(0.1) and betas[9] == pytest.approx((0.9, 0.99))  # end of the cycle
    # decay: n = (it - 10 + 1) / decay_step_size
    assert lr[10] == pytest.approx(0.1 / (1 + 0.5))
    assert lr[12] == pytest.approx(0.1 / (1 + 1.5))
    assert betas[12] == pytest.approx((0.9 * (1 + 0.1 * 1.5), 0.99))
    assert s2.get_mom() == [betas[12]]


def test_one_cycle_asymmetric_halves_and_no_decay():
    s = OneCycle(_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=2, cycle_second_step_size=4)
    lr = _trace(s, 8)
    assert [lr[i] for i in range(-1, 9)] == pytest.approx([0, 0.5, 1, 0.75, 0.5, 0.25, 0, 0, 0, 0])


def test_one_cycle_staircase():
    s = OneCycle(_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    lr = _trace(s, 7)
    assert [lr[i] for i in range(8)] == pytest.approx([0, 0.5, 0.5, 1, 0.5, 0.5, 0, 0])


def test_one_cycle_leaves_sgd_momentum_alone_like_deepspeed(caplog):
    opt = _optimizer(lr=1.0, cls=torch.optim.SGD, momentum=0.5)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        s = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=5)
    assert "cycle_momentum is disabled" in caplog.text
    lr = _trace(s, 4)
    assert lr[4] == pytest.approx(1.1) and opt.param_groups[0]["momentum"] == 0.5
    assert s.get_mom() is None


def test_lr_range_test_continuous_and_staircase():
    s = LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2, lr_range_test_step_rate=1.0)
    lr = _trace(s, 2)
    assert [lr[i] for i in range(-1, 3)] == pytest.approx([0.01, 0.015, 0.02, 0.025])
    s = LRRangeTest(
        _optimizer(),
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=2,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=True,
    )
    lr = _trace(s, 3)
    assert [lr[i] for i in range(-1, 4)] == pytest.approx([0.01, 0.01, 0.03, 0.03, 0.05])


def test_per_group_lists():
    opt = _optimizer(groups=2)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.1]
    s.step(2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.2])
    s = OneCycle(
        opt,
        cycle_min_lr=[0.1, 0.2],
        cycle_max_lr=[1.1, 0.4],
        cycle_first_step_size=2,
        cycle_min_mom=[0.8, 0.7],
        cycle_max_mom=[0.9, 0.95],
    )
    s.step(1)  # the peak
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.1, 0.4])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.7])
    LRRangeTest(opt, lr_range_test_min_lr=[0.01, 0.02])
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02]
    with pytest.raises(ValueError, match="warmup_min_lr has 3 values but the optimizer has 2 param groups"):
        WarmupLR(opt, warmup_min_lr=[0, 0, 0])


def test_get_lr_get_last_lr_and_jumps():
    s = WarmupDecayLR(_optimizer(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    assert s.get_last_lr() == [0.0]
    s.step(10)
    assert s.get_lr() == s.get_last_lr() == [pytest.approx(10 / 16)]
    sequential = WarmupDecayLR(
        _optimizer(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"
    )
    assert _trace(sequential, 10)[10] == s.get_last_lr()[0]


_CASES = [
    (WarmupLR, {"warmup_num_steps": 5}),
    (WarmupDecayLR, {"total_num_steps": 9, "warmup_num_steps": 3}),
    (WarmupCosineLR, {"total_num_steps": 9, "warmup_num_steps": 3}),
    (
        OneCycle,
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 3,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.1,
        },
    ),
    (LRRangeTest, {"lr_range_test_step_size": 3}),
]


@pytest.mark.parametrize("cls,kwargs", _CASES, ids=[c.__name__ for c, _ in _CASES])
def test_state_dict_is_json_and_resumes_identically(cls, kwargs):
    a = cls(_optimizer(groups=2), **kwargs)
    for _ in range(4):
        a.step()
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"last_batch_iteration": 3}
    b = cls(_optimizer(groups=2), **kwargs)
    b.load_state_dict(state)
    assert b.get_last_lr() == a.get_last_lr()  # written at load, before any step
    for _ in range(8):
        a.step()
        b.step()
        assert [dict(g, params=None) for g in a.optimizer.param_groups] == [
            dict(g, params=None) for g in b.optimizer.param_groups
        ]


@pytest.mark.parametrize("cls,kwargs", _CASES, ids=[c.__name__ for c, _ in _CASES])
def test_starting_at_an_iteration_matches_stepping_to_it(cls, kwargs):
    stepped = cls(_optimizer(), **kwargs)
    for _ in range(6):
        stepped.step()
    started = cls(_optimizer(), last_batch_iteration=5, **kwargs)
    assert started.get_last_lr() == stepped.get_last_lr()


def test_build_by_name():
    opt = _optimizer()
    s = build_lr_scheduler(
        SimpleNamespace(type="WarmupLR", params={"warmup_num_steps": 3, "warmup_max_lr": "auto"}), opt
    )
    assert isinstance(s, WarmupLR) and s.max_lrs == [0.1]  # "auto": the default (the optimizer's lr)
    s = build_lr_scheduler(
        SimpleNamespace(type="WarmupDecayLR", params={"total_num_steps": 10, "last_batch_iteration": 4}), opt
    )
    assert s.last_batch_iteration == 4
    s = build_lr_scheduler(SimpleNamespace(type="OneCycle", params={"cycle_min_lr": 0.1, "cycle_max_lr": 1}), opt)
    assert isinstance(s, OneCycle)


def test_build_errors():
    opt = _optimizer()
    with pytest.raises(
        ValueError,
        match=r"scheduler.params.warmup_num_step is not a parameter of WarmupLR; "
        r"did you mean 'warmup_num_steps'\? \(allowed: warmup_min_lr",
    ):
        build_lr_scheduler(SimpleNamespace(type="WarmupLR", params={"warmup_num_step": 3}), opt)
    with pytest.raises(ValueError, match="needs scheduler.params.total_num_steps"):
        build_lr_scheduler(SimpleNamespace(type="WarmupDecayLR", params={"warmup_max_lr": 0.1}), opt)
    with pytest.raises(ValueError, match="unknown scheduler 'WarmupCosineLr'; did you mean 'WarmupCosineLR'"):
        build_lr_scheduler(SimpleNamespace(type="WarmupCosineLr", params={}), opt)
