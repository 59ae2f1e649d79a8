import logging

import pytest

from shardwise.config import load_config
from shardwise.precision import LossScaler, PrecisionPolicy


def _scaler(**fp16):
    config = load_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, **fp16}}, world_size=1)
    return LossScaler.from_config(config.fp16)


def test_defaults_match_deepspeed():
    scaler = _scaler()
    assert scaler.dynamic and scaler.scale == 2.0**16
    assert (scaler.window, scaler.hysteresis, scaler.min_scale) == (1000, 2, 1.0)


def test_hysteresis_delays_the_halving():
    scaler = _scaler(initial_scale_power=10, hysteresis=2)
    scaler.update(overflow=True)
    assert scaler.scale == 1024.0
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    scaler.update(overflow=True)
    assert scaler.scale == 256.0  # budget not refilled without a growth window


def test_window_of_clean_steps_doubles_and_refills_hysteresis():
    scaler = _scaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    scaler.update(overflow=True)  # iteration 0: uses one unit of hysteresis
    assert scaler.scale == 16.0
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 16.0
    scaler.update(overflow=False)  # 3 clean steps since the overflow
    assert scaler.scale == 32.0
    scaler.update(overflow=True)  # hysteresis refilled: tolerated
    assert scaler.scale == 32.0


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = _scaler(initial_scale_power=4, hysteresis=2, consecutive_hysteresis=True)
    for _ in range(3):
        scaler.update(overflow=True)
        scaler.update(overflow=False)
    assert scaler.scale == 16.0


def test_min_scale_is_a_floor_and_warns_instead_of_exiting(caplog):
    scaler = _scaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    logger = logging.getLogger("shardwise")
    logger.addHandler(caplog.handler)
    try:
        for _ in range(10):
            scaler.update(overflow=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert scaler.scale == 1.0
    assert "overflowed 5 times at the minimum loss scale" in caplog.text


def test_static_scale_never_changes():
    scaler = _scaler(loss_scale=128)
    assert not scaler.dynamic
    for overflow in (True, False, True):
        scaler.update(overflow=overflow)
    assert scaler.scale == 128.0


def test_state_round_trip_continues_identically():
    a = _scaler(initial_scale_power=5, loss_scale_window=2)
    for overflow in (True, False, True, True, False):
        a.update(overflow=overflow)
    b = _scaler(initial_scale_power=9, loss_scale_window=2)
    b.load_state_dict(a.state_dict())
    for overflow in (False, False, True, False, False, False):
        a.update(overflow=overflow)
        b.update(overflow=overflow)
        assert a.scale == b.scale


@pytest.mark.parametrize(
    "section,dtype",
    [({}, "float32"), ({"bf16": {"enabled": True}}, "bfloat16"), ({"fp16": {"enabled": True}}, "float16")],
)
def test_policy_from_config(section, dtype):
    policy = PrecisionPolicy.from_config(load_config({"train_micro_batch_size_per_gpu": 1, **section}, world_size=1))
    assert str(policy.param_dtype) == f"torch.{dtype}"
    assert policy.loss_scaling == (dtype == "float16")
    assert policy.needs_master_copy == (dtype != "float32")
