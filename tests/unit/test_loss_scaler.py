"""DeepSpeed's dynamic loss-scale rules, step by step, against values worked out by hand."""

from __future__ import annotations

from shardwrap.deepspeed.config import FP16Config
from shardwrap.deepspeed.loss_scaler import LossScaler


def scales(config: FP16Config, overflows: list[bool]) -> list[float]:
    scaler = LossScaler(config)
    seen = []
    for overflow in overflows:
        scaler.update(overflow)
        seen.append(scaler.scale)
    return seen


def test_window_doubles_and_hysteresis_delays_halving():
    config = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    # clean, clean -> x2 at the window; overflow uses up hysteresis; the next one halves;
    # the window counts from the last overflow.
    got = scales(config, [False, False, True, True, False, False, False])
    assert got == [16.0, 32.0, 32.0, 16.0, 16.0, 32.0, 32.0]


def test_min_scale_and_static_scale():
    floor = FP16Config(enabled=True, initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    assert scales(floor, [True, True, True]) == [1.0, 1.0, 1.0]
    static = FP16Config(enabled=True, loss_scale=128.0)
    assert scales(static, [True, False, True]) == [128.0, 128.0, 128.0]


def test_consecutive_hysteresis_restores_after_a_clean_step():
    config = FP16Config(
        enabled=True,
        initial_scale_power=4,
        loss_scale_window=100,
        hysteresis=2,
        consecutive_hysteresis=True,
    )
    # overflow, clean (restores), overflow (absorbed again): the scale never halves
    assert scales(config, [True, False, True]) == [16.0, 16.0, 16.0]
    plain = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    assert scales(plain, [True, False, True]) == [16.0, 16.0, 8.0]


def test_state_round_trip():
    config = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    first = LossScaler(config)
    for overflow in [False, True]:
        first.update(overflow)
    second = LossScaler(config)
    second.load_state_dict(first.state_dict())
    for overflow in [True, False, False]:
        first.update(overflow)
        second.update(overflow)
        assert second.state_dict() == first.state_dict()
