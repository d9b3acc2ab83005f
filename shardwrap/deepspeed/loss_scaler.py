"""DeepSpeed's fp16 loss scaling rules, for the engine.

[Note: DeepSpeed's dynamic loss scale]
With ``fp16.loss_scale`` 0 the scale starts at ``2**initial_scale_power``. A step whose
gradients hold an inf/NaN on any rank is skipped; it halves the scale (never below
``min_loss_scale``) once ``hysteresis`` overflows have been absorbed, and otherwise just
uses up one unit of hysteresis. After ``loss_scale_window`` steps without an overflow the
scale doubles and the hysteresis is restored (with ``consecutive_hysteresis`` it is also
restored after every clean step). A static scale (``loss_scale`` > 0) never changes and,
as in DeepSpeed, steps are never skipped.
"""

from __future__ import annotations

from typing import Any

from .config import FP16Config

_SCALE_FACTOR = 2.0


class LossScaler:
    """The scale to multiply the loss by, and its update after each optimizer step."""

    def __init__(self, config: FP16Config) -> None:
        self.dynamic = config.dynamic_loss_scale
        self.scale = config.initial_loss_scale
        self.min_scale = config.min_loss_scale
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.hysteresis_left = config.hysteresis
        self.num_updates = 0  # optimizer steps seen (taken or skipped)
        self.last_overflow = -1  # num_updates at the last overflow

    def update(self, overflow: bool) -> None:
        """Apply one step's outcome (the same on every rank) to the scale."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / _SCALE_FACTOR, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.num_updates
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.num_updates - self.last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= _SCALE_FACTOR
        self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "num_updates": self.num_updates,
            "last_overflow": self.last_overflow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.num_updates = int(state["num_updates"])
        self.last_overflow = int(state["last_overflow"])
