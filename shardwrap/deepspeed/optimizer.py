"""The ``optimizer`` and ``scheduler`` blocks of a DeepSpeed config, and building them.

[Note: DeepSpeed's "Adam"]
DeepSpeed builds ``"type": "Adam"`` with decoupled weight decay unless the block says
``"adam_w_mode": false`` (its ``adam_w_mode`` default is true), and its Adam family
defaults ``weight_decay`` to 0. We keep both semantics, so a DeepSpeed config trains the
same here: ``Adam`` -> ``torch.optim.AdamW`` (or ``torch.optim.Adam`` when
``adam_w_mode`` is false), ``AdamW`` -> ``torch.optim.AdamW``, ``SGD`` -> ``torch.optim.SGD``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import keys as ds_keys
from . import lr_schedules
from .sections import Section, unknown_key_message
from .unused import note_unused


class OptimizerType(enum.Enum):
    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"


class SchedulerType(enum.Enum):
    WARMUP_LR = "WarmupLR"
    WARMUP_DECAY_LR = "WarmupDecayLR"
    WARMUP_COSINE_LR = "WarmupCosineLR"


_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "foreach"}
# DeepSpeed's Adam-family params that we do not implement ([Note: DeepSpeed's keys]).
_ADAM_REFUSED = {
    "fp32_optimizer_states": (
        ds_keys.OffWhen(lambda value: value in (None, True)),
        ds_keys.valid_but_unsupported("optimizer state is always fp32 here"),
    ),
}
_OPTIMIZER_KEYS = {
    OptimizerType.ADAM: _ADAM_KEYS | {"adam_w_mode"},
    OptimizerType.ADAMW: _ADAM_KEYS,
    OptimizerType.SGD: {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
}
_UNSUPPORTED_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lion", "Adagrad")

_WARMUP_KEYS = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
_SCHEDULER_KEYS = {
    SchedulerType.WARMUP_LR: _WARMUP_KEYS,
    SchedulerType.WARMUP_DECAY_LR: _WARMUP_KEYS | {"total_num_steps"},
    SchedulerType.WARMUP_COSINE_LR: {
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
    },
}
_UNSUPPORTED_SCHEDULERS = ("OneCycle", "LRRangeTest")
# Resuming a schedule goes through engine.load_checkpoint, which restores its state.
_RESUME_REASON = "resume the schedule with engine.load_checkpoint instead"


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """``optimizer: {type, params}``; ``params`` are validated keyword arguments."""

    type: OptimizerType
    params: tuple[tuple[str, Any], ...]  # (name, value) pairs, defaults filled in

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def build(self, parameters: Iterable[Any]) -> torch.optim.Optimizer:
        """The torch optimizer over ``parameters`` (tensors or param-group dicts)."""
        kwargs = self.kwargs
        if self.type is OptimizerType.SGD:
            return torch.optim.SGD(parameters, **kwargs)
        decoupled = kwargs.pop("adam_w_mode", True)
        optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
        return optimizer_class(parameters, **kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """``scheduler: {type, params}``; formulas in :mod:`shardwrap.deepspeed.lr_schedules`."""

    type: SchedulerType
    params: tuple[tuple[str, Any], ...]

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        scheduler_class = {
            SchedulerType.WARMUP_LR: lr_schedules.WarmupLR,
            SchedulerType.WARMUP_DECAY_LR: lr_schedules.WarmupDecayLR,
            SchedulerType.WARMUP_COSINE_LR: lr_schedules.WarmupCosineLR,
        }[self.type]
        return scheduler_class(optimizer, **dict(self.params))


def parse_optimizer(raw: object) -> OptimizerConfig:
    block = Section("optimizer", raw, known={"type", "params"})
    type_name = block.get("type")
    members = {m.value: m for m in OptimizerType}
    if not isinstance(type_name, str):
        raise ValueError(f"optimizer.type: required, one of Adam, AdamW, SGD; got {type_name!r}")
    if type_name in _UNSUPPORTED_OPTIMIZERS:
        raise ValueError(f"optimizer.type: {type_name!r} is not supported; use Adam, AdamW or SGD")
    if type_name.lower() not in members:
        raise ValueError(
            unknown_key_message("optimizer.type", type_name, {"Adam", "AdamW", "SGD"}).replace(
                "unknown key", "unknown optimizer"
            )
        )
    kind = members[type_name.lower()]
    params = Section(
        "optimizer.params",
        block.section("params"),
        known=_OPTIMIZER_KEYS[kind],
        unsupported=_ADAM_REFUSED if kind is not OptimizerType.SGD else None,
    )
    values: dict[str, Any] = {"lr": params.number("lr", 1e-3, minimum=0.0)}
    values["weight_decay"] = params.number("weight_decay", 0.0, minimum=0.0)
    if kind is OptimizerType.SGD:
        values["momentum"] = params.number("momentum", 0.0, minimum=0.0)
        values["dampening"] = params.number("dampening", 0.0, minimum=0.0)
        values["nesterov"] = params.boolean("nesterov", False)
    else:
        values["betas"] = _betas(params.get("betas", (0.9, 0.999)))
        values["eps"] = params.number("eps", 1e-8, minimum=0.0)
        values["amsgrad"] = params.boolean("amsgrad", False)
        # torch's Adam is always used: what torch_adam: true asks for
        note_unused(params, "torch_adam", params.boolean("torch_adam", False))
        foreach = params.get("foreach")
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(
                f"optimizer.params.foreach: expected true, false or null, got {foreach!r}"
            )
        if foreach is not None:
            values["foreach"] = foreach  # passed to torch's Adam/AdamW, as DeepSpeed does
        if kind is OptimizerType.ADAM:
            values["adam_w_mode"] = params.boolean("adam_w_mode", True)
    return OptimizerConfig(type=kind, params=tuple(values.items()))


def _betas(value: object) -> tuple[float, float]:
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)
        and all(0.0 <= b < 1.0 for b in value)
    )
    if not ok:
        raise ValueError(f"optimizer.params.betas: expected two numbers in [0, 1), got {value!r}")
    return (float(value[0]), float(value[1]))  # type: ignore[index]


def parse_scheduler(raw: object) -> SchedulerConfig:
    block = Section("scheduler", raw, known={"type", "params"})
    type_name = block.get("type")
    members = {m.value: m for m in SchedulerType}
    if type_name in _UNSUPPORTED_SCHEDULERS:
        raise ValueError(
            f"scheduler.type: {type_name!r} is not supported by shardwrap; "
            f"supported: {', '.join(members)}"
        )
    if not isinstance(type_name, str) or type_name not in members:
        if not isinstance(type_name, str):
            raise ValueError(f"scheduler.type: required, one of {', '.join(members)}")
        message = unknown_key_message("scheduler.type", type_name, set(members))
        raise ValueError(message.replace("unknown key", "unknown scheduler"))
    kind = members[type_name]
    params = Section(
        "scheduler.params",
        block.section("params"),
        known=_SCHEDULER_KEYS[kind],
        unsupported={"last_batch_iteration": (-1, _RESUME_REASON)},
    )
    values = {key: params.get(key) for key in _SCHEDULER_KEYS[kind] if params.has(key)}
    for key in ("warmup_num_steps", "total_num_steps"):
        if key in values:
            values[key] = params.integer(key, None)
    if "total_num_steps" in _SCHEDULER_KEYS[kind] and "total_num_steps" not in values:
        raise ValueError(f"scheduler.params.total_num_steps: required by {type_name}")
    _check_scheduler_values(kind, values)
    return SchedulerConfig(type=kind, params=tuple(sorted(values.items())))


def _check_scheduler_values(kind: SchedulerType, values: dict[str, Any]) -> None:
    """Build once against a throwaway optimizer, so bad values fail at parse time."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    # Per-group lists are checked against the real optimizer's groups when it is built.
    scalars = {k: v[0] if isinstance(v, (list, tuple)) and v else v for k, v in values.items()}
    try:
        SchedulerConfig(type=kind, params=tuple(scalars.items())).build(probe)
    except (TypeError, ValueError) as error:
        raise ValueError(f"scheduler.params: {error}") from None
