"""Torch's FSDP option records and enum members turned into ours, field by field.

This is the one place where ``torch.distributed.fsdp``'s ``CPUOffload``, ``MixedPrecision``,
``FullStateDictConfig``, ``FullOptimStateDictConfig`` and the like become shardwrap's
records. A record is recognised by its class name (torch's record and ours share it) and
rebuilt from our fields; a field torch keeps private (``_module_classes_to_ignore``) is
read under its underscored name. Fields torch has and we do not (``_use_dtensor``) must
hold their default, or the conversion is refused rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
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
