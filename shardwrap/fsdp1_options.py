"""FSDP1's remaining public option records: optimizer state-dict configs, settings, key type.

They complete :mod:`shardwrap.options` (same layer) with the names
``torch.distributed.fsdp`` exports; torch's own records are accepted wherever these are
(see :mod:`shardwrap.base.records`).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any

from .base.records import as_record
from .base.validate import check_bools
from .options import FullStateDictConfig, ShardedStateDictConfig, StateDictType, _parse_member


class StateDictConfig(abc.ABC):  # noqa: B024 - a marker base, as torch's is
    """Base of the model state-dict configs (``isinstance`` checks only)."""


StateDictConfig.register(FullStateDictConfig)
StateDictConfig.register(ShardedStateDictConfig)


@dataclass(frozen=True)
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs; ``offload_to_cpu`` as torch (default on)."""

    offload_to_cpu: bool = True

    def __post_init__(self) -> None:
        check_bools(self, "offload_to_cpu")


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``FULL_STATE_DICT`` optimizer state: whole tensors; ``rank0_only``: others get ``{}``
    from ``optim_state_dict`` and may pass ``None``/``{}`` to ``optim_state_dict_to_load``,
    which then receives rank 0's state by broadcast."""

    rank0_only: bool = False

    def __post_init__(self) -> None:
        check_bools(self, "offload_to_cpu", "rank0_only")


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """``SHARDED_STATE_DICT`` optimizer state: this rank's pieces."""


@dataclass(frozen=True)
class StateDictSettings:
    """What ``get_state_dict_type``/``set_state_dict_type`` return (torch's three fields)."""

    state_dict_type: StateDictType
    state_dict_config: FullStateDictConfig | ShardedStateDictConfig
    optim_state_dict_config: FullOptimStateDictConfig | ShardedOptimStateDictConfig


class OptimStateKeyType(enum.Enum):
    """How ``rekey_optim_state_dict`` keys the state: by parameter name or by position."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()

    @classmethod
    def parse(cls, value: object) -> OptimStateKeyType:
        member = _parse_member(cls, value)
        if member is None:
            raise ValueError(
                f"optim_state_key_type: unknown value {value!r}; allowed: PARAM_NAME, PARAM_ID"
            )
        return member


_LOCAL = (
    "LOCAL_STATE_DICT is not supported: its per-rank flat pieces cannot be resharded and "
    "torch.distributed.checkpoint would keep one rank's piece per key. Use "
    "SHARDED_STATE_DICT (DTensors that DCP reshards), FULL_STATE_DICT or "
    "shardwrap.save_checkpoint"
)


def model_config(kind: StateDictType, config: Any):
    """``config`` as our model config for ``kind`` (``None``: the default)."""
    expected = (
        FullStateDictConfig if kind is StateDictType.FULL_STATE_DICT else ShardedStateDictConfig
    )
    if config is None:
        return expected()
    _refuse_local(config)
    return _of_kind("state_dict_config", kind, config, expected)


def optim_config(kind: StateDictType, config: Any):
    """``config`` as our optimizer config for ``kind`` (``None``: the default)."""
    expected = (
        FullOptimStateDictConfig
        if kind is StateDictType.FULL_STATE_DICT
        else ShardedOptimStateDictConfig
    )
    if config is None:
        return expected()
    _refuse_local(config)
    return _of_kind("optim_state_dict_config", kind, config, expected)


def _of_kind(argument: str, kind: StateDictType, config: Any, expected: type):
    try:
        return as_record(argument, config, expected)
    except TypeError:
        raise TypeError(
            f"{argument}: {kind.name} takes {expected.__name__}, got {type(config).__name__}"
        ) from None


def _refuse_local(config: Any) -> None:
    if type(config).__name__.startswith("Local"):
        raise ValueError(f"{type(config).__name__}: {_LOCAL}")


def parse_state_dict_type(value: object) -> StateDictType:
    if getattr(value, "name", value) == "LOCAL_STATE_DICT":
        raise ValueError(f"state_dict_type: {_LOCAL}")
    return StateDictType.parse(value)
