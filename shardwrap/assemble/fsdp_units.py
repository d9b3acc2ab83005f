"""Units that are FSDP instances to whoever looks, without a wrapper module.

[Note: units as FSDP instances]
FSDP1 puts a wrapper module around every unit, so code written for it (accelerate, the
Hugging Face Trainer, Lightning, torch's own tests) finds units with
``isinstance(m, FullyShardedDataParallel)`` and ``FSDP.fsdp_modules(model)``. A wrapper
would put ``_fsdp_wrapped_module.`` into parameter and state-dict names. Instead, as FSDP2
does, each unit's module has its class swapped for a subclass of its own class and of
:class:`FSDPUnit`, under the same name, and ``ShardedModule``'s metaclass counts an
``FSDPUnit`` as an instance of ``ShardedModule``. Forward, parameters, hooks and state
dicts stay the module's own. The root's own module is not swapped: the root
``ShardedModule`` is the FSDP instance there, as FSDP1's root wrapper is.

Members a unit module gains must not take names from the model: methods are safe (the
module's own class comes first in the swapped class), and ``training_state`` yields to an
attribute of the module's own; FSDP1 attributes a model plausibly has itself
(``process_group``, ``rank``, ``world_size``) are the root wrapper's only
(``FSDP1RootAttributes``), and ``module`` (FSDP1's wrapper attribute) is not given at all:
``unit.module`` returning the unit would make unwrap loops (``while isinstance(m, FSDP):
m = m.module``) never end.
The ``_``-prefixed members below are FSDP1 instance attributes that popular frameworks
read (accelerate's mixed-precision pass reads ``_has_params``, ``_flat_param`` and
``_handle``). They are compatibility, not API: each answers what FSDP1's would, as far as
that code needs, and refuses what shardwrap cannot honour with an error saying so.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NoReturn

import torch
from torch import nn

from ..core.unit import Unit
from ..runtime.fsdp1_state import (
    assert_training_state,
    root_training_state,
    unit_training_state,
)
from .root import find_root, own_unit, root_of

# Original class -> its swapped subclass, so every unit of one class shares one class.
_NOT_SET = object()
_SWAPPED: dict[type, type] = {}


class FSDPMeta(type):
    """Metaclass of the root class: its ``isinstance``/``issubclass`` accept every unit
    module too. Only the class that sets ``_answers_for_units`` in its own body does this
    (``ShardedModule``; not a user's subclass of it).
    """

    def __instancecheck__(cls, obj: object) -> bool:
        return super().__instancecheck__(obj) or (
            cls.__dict__.get("_answers_for_units", False) and isinstance(obj, FSDPUnit)
        )

    def __subclasscheck__(cls, sub: type) -> bool:
        return super().__subclasscheck__(sub) or (
            cls.__dict__.get("_answers_for_units", False)
            and isinstance(sub, type)
            and issubclass(sub, FSDPUnit)
        )


class FSDP1Attributes:
    """FSDP1 instance attributes frameworks read, of the unit a unit module became or a
    root's own unit (the registry answers both)."""

    @property
    def _fsdp_unit(self) -> Unit:
        unit = own_unit(self)  # type: ignore[arg-type]
        if unit is None:
            raise RuntimeError(f"{type(self).__name__}: no ShardedModule manages this module")
        return unit

    @property
    def training_state(self) -> Enum:
        """FSDP1's state of this instance (a root's spans its whole model), a member of
        torch's ``TrainingState`` (``runtime/fsdp1_state.py``). A unit module's own
        attribute of this name is its own: read and written as before wrapping."""
        own = self.__dict__.get("training_state", _NOT_SET)
        if own is not _NOT_SET:
            return own
        root = find_root(self)  # type: ignore[arg-type]
        if root is not None:
            return root_training_state(self._fsdp_unit, root.units)
        return unit_training_state(self._fsdp_unit)

    @training_state.setter
    def training_state(self, value: Any) -> None:  # only a unit module's own attribute
        self.__dict__["training_state"] = value

    def _assert_state(self, state: Any) -> None:
        """FSDP1's check: ``ValueError`` unless :attr:`training_state` is ``state`` (or one
        of a list of them)."""
        assert_training_state(self.training_state, state)

    @property
    def _has_params(self) -> bool:
        return self._fsdp_unit.handle is not None

    @property
    def _flat_param(self) -> FlatParamView | None:
        handle = self._fsdp_unit.handle
        return None if handle is None else FlatParamView(handle)

    @property
    def _handle(self) -> HandleView | None:
        handle = self._fsdp_unit.handle
        return None if handle is None else HandleView(handle)


class FSDP1RootAttributes:
    """FSDP1 instance attributes of the root wrapper (not of unit modules, whose own
    attributes of these names must stay theirs): the group it shards over, its rank and
    size, and indexing that reaches the wrapped module."""

    @property
    def process_group(self) -> Any:
        """FSDP1's ``process_group``: the group the model shards over (the intra-node,
        shard group under hybrid sharding)."""
        root = root_of(self, "self")
        if root.options.sharding_strategy.is_hybrid:
            return root.comms.shard.group
        return root.comms.world.group

    def __getitem__(self, key: Any) -> Any:
        """Indexing reaches the wrapped module (an ``nn.Sequential``), as FSDP1's does."""
        return self.module[key]  # type: ignore[attr-defined]

    @property
    def rank(self) -> int:
        """This rank in :attr:`process_group`."""
        return self.process_group.rank()

    @property
    def world_size(self) -> int:
        """The size of :attr:`process_group`."""
        return self.process_group.size()


class FSDPUnit(FSDP1Attributes):
    """Mixed into a unit module's class: what an FSDP1 unit shows besides the module."""

    def check_is_root(self) -> bool:
        """A unit is never a root (the ``ShardedModule`` around the model is)."""
        return False

    @property
    def _is_root(self) -> bool:
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> NoReturn:
        """Refused, as FSDP1 refuses it on a non-root instance: the norm spans every unit."""
        raise RuntimeError(
            "clip_grad_norm_() should only be called on the root FSDP instance (the "
            "ShardedModule around the model): the norm spans every unit's gradients"
        )


class FlatParamView:
    """What FSDP1's ``FlatParameter`` tells frameworks about a unit's flat shard."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @property
    def dtype(self) -> torch.dtype:
        return self._handle.flat_shard.dtype

    @property
    def device(self) -> torch.device:
        return self._handle.flat_shard.device

    @property
    def shape(self) -> torch.Size:
        return self._handle.flat_shard.shape

    def numel(self) -> int:
        return self._handle.flat_shard.numel()

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self._handle.shard_params)

    @property
    def _fqns(self) -> list[str]:
        return [info.fqn for info in self._handle.layout.params]

    @property
    def data(self) -> torch.Tensor:
        return self._handle.flat_shard.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        raise TypeError(
            f"unit {self._handle.comm_label!r}: shardwrap cannot replace a unit's flat shard "
            f"(here to {value.dtype}); build the model in the dtype its master weights should "
            "have (float32 with mixed_precision) before wrapping"
        )


class HandleView:
    """What FSDP1's ``FlatParamHandle`` tells frameworks about a unit."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        return self._handle.dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, value: torch.dtype) -> None:
        if value != self._handle.dtype:
            raise TypeError(
                f"unit {self._handle.comm_label!r}: master weights are {self._handle.dtype}; "
                f"shardwrap cannot change them to {value} after wrapping"
            )


def as_fsdp_unit(module: nn.Module) -> None:
    """Swap ``module``'s class for its ``FSDPUnit`` subclass (once; same class name)."""
    cls = type(module)
    if issubclass(cls, FSDPUnit):
        return
    swapped = _SWAPPED.get(cls)
    if swapped is None:
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        swapped = _SWAPPED[cls] = type(cls.__name__, (cls, FSDPUnit), namespace)
    module.__class__ = swapped
