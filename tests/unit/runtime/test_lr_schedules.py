import json
import math
from types import SimpleNamespace

import pytest
import torch

from shardwise.runtime.lr_schedules import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR,
                                            WarmupLR, build_lr_scheduler)


def _optimizer(groups=1, lr=0.1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.AdamW(params, lr=lr)


def _lrs(scheduler, steps):
    """lr in force for optimizer steps 1..steps (the scheduler steps after each)."""
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step()
    return out


def test_warmup_lr_log_and_linear():
    opt = _optimizer()
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.0
    lrs = _lrs(s, 13)
    assert lrs[:2] == [0.0, 0.0]
    assert lrs[2] == pytest.approx(math.log(2) / math.log(10))   # iteration 1
    assert lrs[11:] == [1.0, 1.0]                                 # held after the warm-up
    s = WarmupLR(_optimizer(), warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4,
                 warmup_type="linear")
    assert _lrs(s, 7) == pytest.approx([0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5])


def test_warmup_decay_reaches_zero_at_total_steps():
    s = WarmupDecayLR(_optimizer(), total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=2,
                      warmup_type="linear")
    lrs = _lrs(s, 13)
    assert lrs[:4] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert lrs[4] == pytest.approx(7 / 8)     # iteration 3: (10 - 3) / (10 - 2)
    assert lrs[11] == 0.0 and lrs[12] == 0.0  # iteration >= total: 0, never negative


def test_warmup_cosine_ratios_of_the_optimizer_lr():
    s = WarmupCosineLR(_optimizer(lr=0.2), total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=2,
                       cos_min_ratio=0.01, warmup_type="linear")
    lrs = _lrs(s, 15)
    assert lrs[0] == pytest.approx(0.02)                      # start: warmup_min_ratio x lr
    assert lrs[3] == pytest.approx(0.2)                       # iteration 2: end of warm-up, full lr
    mid = 0.2 * (0.01 + 0.99 * (1 + math.cos(math.pi * 5 / 10)) / 2)
    assert lrs[8] == pytest.approx(mid)                       # iteration 7: halfway down
    assert lrs[14] == pytest.approx(0.2 * 0.01)               # past the end: the floor


def test_one_cycle_triangle_momentum_and_decay():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)
    s = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=5, decay_lr_rate=1.0,
                 decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9)
    lrs, moms = [], []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["momentum"])
        s.step()
    assert lrs[0] == pytest.approx(0.1) and moms[0] == pytest.approx(0.9)
    assert lrs[5] == pytest.approx(1.1) and moms[5] == pytest.approx(0.8)   # peak of the cycle
    assert lrs[10] == pytest.approx(0.1)                                    # end of the cycle
    # decay phase: iteration 12 is decay step 12 - 10 + 1 = 3, interval 3 / 2
    assert lrs[13] == pytest.approx(0.1 / (1 + 1.0 * 3 / 2))


def test_lr_range_test_continuous_and_staircase():
    s = LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                    lr_range_test_step_rate=1.0)
    assert _lrs(s, 4) == pytest.approx([0.01, 0.015, 0.02, 0.025])
    s = LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                    lr_range_test_step_rate=1.0, lr_range_test_staircase=True)
    assert _lrs(s, 4) == pytest.approx([0.01, 0.01, 0.02, 0.02])


def test_per_group_lists():
    opt = _optimizer(groups=2)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2,
                 warmup_type="linear")
    for _ in range(3):
        s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.2])
    with pytest.raises(ValueError, match="warmup_min_lr has 3 values but the optimizer has 2"):
        WarmupLR(opt, warmup_min_lr=[0, 0, 0])


@pytest.mark.parametrize("cls,kwargs", [
    (WarmupLR, {"warmup_num_steps": 5}), (WarmupDecayLR, {"total_num_steps": 9, "warmup_num_steps": 3}),
    (WarmupCosineLR, {"total_num_steps": 9, "warmup_num_steps": 3}),
    (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}),
    (LRRangeTest, {"lr_range_test_step_size": 3})])
def test_state_dict_is_json_and_resumes_identically(cls, kwargs):
    a = cls(_optimizer(), **kwargs)
    _lrs(a, 4)
    state = json.loads(json.dumps(a.state_dict()))
    b = cls(_optimizer(), **kwargs)
    b.load_state_dict(state)
    assert _lrs(a, 6) == _lrs(b, 6)


def test_build_by_name_with_errors():
    opt = _optimizer()
    s = build_lr_scheduler(SimpleNamespace(type="WarmupLR", params={"warmup_num_steps": 3,
                                                                    "warmup_max_lr": "auto"}), opt)
    assert isinstance(s, WarmupLR) and s.max_lrs == [0.001]
    with pytest.raises(ValueError, match="warmup_num_step is not a parameter of WarmupLR; did you mean "
                                         "'warmup_num_steps'"):
        build_lr_scheduler(SimpleNamespace(type="WarmupLR", params={"warmup_num_step": 3}), opt)
    with pytest.raises(ValueError, match="needs scheduler.params.total_num_steps"):
        build_lr_scheduler(SimpleNamespace(type="WarmupDecayLR", params={}), opt)
