"""Torch's FSDP option records and enum members turned into ours, field by field.

This is the one place where ``torch.distributed.fsdp``'s ``CPUOffload``, ``MixedPrecision``,
``FullStateDictConfig``, ``FullOptimStateDictConfig`` and the like become shardwrap's
records. A record is recognised by its class name (torch's record and ours share it) and
rebuilt from our fields; a field torch keeps private (``_module_classes_to_ignore``) is
read under its underscored name. Fields torch has and we do not (``_use_dtensor``) must
hold their default, or the conversion is refused rather than silently dropped.

Our records and members also compare equal to torch's counterparts (``equals_torch_*``):
a model wrapped with torch's ``MixedPrecision`` answers ``model.mixed_precision == mp``,
and ``model.sharding_strategy == ShardingStrategy.FULL_SHARD`` with torch's enum.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Any, TypeVar

_R = TypeVar("_R")

# Torch-only private fields we accept only at these values (anything else changes meaning).
_IGNORABLE = {"_use_dtensor": False}


def as_record(argument: str, value: Any, *classes: type[_R]) -> _R:
    """``value`` as an instance of one of ``classes`` (dataclasses of ours).

    ``value`` may already be one, or torch's record of the same class name.
    """
    if isinstance(value, classes):
        return value
    for cls in classes:
        if type(value).__name__ == cls.__name__ and dataclasses.is_dataclass(value):
            return _convert(argument, value, cls)
    names = " or ".join(c.__name__ for c in classes)
    raise TypeError(f"{argument}: expected {names}, got {type(value).__name__}")


def _convert(argument: str, value: Any, cls: type[_R]) -> _R:
    ours = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for field in dataclasses.fields(value):
        name = field.name.lstrip("_") if field.name.lstrip("_") in ours else field.name
        given = getattr(value, field.name)
        if name in ours:
            kwargs[name] = given
        elif name in _IGNORABLE and given == _IGNORABLE[name]:
            continue
        else:
            raise ValueError(
                f"{argument}: torch's {type(value).__name__}.{field.name}={given!r} has no "
                f"counterpart in shardwrap's {cls.__name__}"
            )
    return cls(**kwargs)


def _is_torchs_twin(ours: object, other: object) -> bool:
    """``other`` is torch's object of the class ``ours`` shares its name with."""
    kind = type(other)
    return (
        kind is not type(ours)
        and kind.__name__ == type(ours).__name__
        and kind.__module__.split(".")[0] == "torch"
    )


def equals_torch_member(member: enum.Enum, other: object) -> Any:
    """``member == other``, where ``other`` may be torch's member of the same enum: equal
    when the names are (``model.sharding_strategy == torch's FULL_SHARD`` holds). Enum
    members hash by name, so equal members of the two enums hash alike."""
    if isinstance(other, enum.Enum) and _is_torchs_twin(member, other):
        return other.name == member.name
    return NotImplemented


def equals_torch_record(record: Any, other: object) -> Any:
    """``record == other`` for a record of ours: field by field, and against torch's record
    of the same name through the conversion (equal when it converts to an equal record)."""
    if type(other) is type(record):
        names = [f.name for f in dataclasses.fields(record)]
        return all(getattr(record, n) == getattr(other, n) for n in names)
    if dataclasses.is_dataclass(other) and _is_torchs_twin(record, other):
        try:
            with warnings.catch_warnings():  # a comparison, not a construction: no warning
                warnings.simplefilter("ignore")
                return as_record("other", other, type(record)) == record
        except (TypeError, ValueError):
            return False
    return NotImplemented
