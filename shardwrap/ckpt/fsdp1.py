"""FSDP1's state-dict-type settings and its optimizer-state calls, legacy ones included.

Built on the name-keyed optimizer state dicts of :mod:`.state_dict`:

* ``set_state_dict_type``/``get_state_dict_type``/``state_dict_type`` take torch's four
  arguments and return torch-like ``StateDictSettings``; the model part is kept by
  :mod:`.state_dict`, the optimizer config here.
* ``optim_state_dict``/``optim_state_dict_to_load`` honour the optimizer config: with
  ``FullOptimStateDictConfig(rank0_only=True)`` only world rank 0 gets the state (the
  others take part in the gathers and get ``{}``), and on load the other ranks may pass
  ``None``/``{}`` and receive rank 0's state through the model's world communicator.
* FSDP1's deprecated calls (``full_optim_state_dict``, ``shard_full_optim_state_dict``,
  ``scatter_full_optim_state_dict``, ``sharded_optim_state_dict``,
  ``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict``) as torch documents
  them: the full form is keyed by parameter name, and ``rekey_optim_state_dict`` converts
  between names and parameter IDs (positions in the optimizer's parameters, or in
  ``model.parameters()`` without an optimizer) for a model that is not wrapped.

What ``shard_``/``scatter_``/``flatten_`` return is ``optim.load_state_dict``'s argument
for this rank's pieces, keyed by position in ``optim`` (or, without ``optim``, in an
optimizer built over the parameters of the saved groups in ``model.parameters()`` order).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..base.warn_once import warn_once
from ..comm.collectives import Communicator
from ..fsdp1_options import (
    FullOptimStateDictConfig,
    StateDictSettings,
    model_config,
    optim_config,
    parse_state_dict_type,
)
from ..options import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from . import state_dict as _sd
from .fsdp1_rekey import names_keyed
from .slots import model_slots

_OPTIM: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ settings
def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The state-dict type of ``module``'s roots, its config and its optimizer config."""
    model = _sd.get_state_dict_type(module)
    roots = _sd._roots(module)
    optim = _OPTIM.get(roots[0]) if roots else None
    return StateDictSettings(
        model.state_dict_type,
        model.state_dict_config,
        optim if optim is not None else optim_config(model.state_dict_type, None),
    )


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> StateDictSettings:
    """Set the state-dict type of every root in ``module``; returns the previous settings."""
    kind = parse_state_dict_type(state_dict_type)
    config = model_config(kind, state_dict_config)
    optim = optim_config(kind, optim_state_dict_config)
    previous = get_state_dict_type(module)
    _sd.set_state_dict_type(module, kind, config)
    for root in _sd._roots(module):
        _OPTIM[root] = optim
    return previous


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """Use the given type and configs for ``module``'s state dicts inside the context."""
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        set_state_dict_type(module, *_fields(previous))


def _fields(settings: StateDictSettings) -> tuple:
    return (settings.state_dict_type, settings.state_dict_config, settings.optim_state_dict_config)


@contextlib.contextmanager
def _temporarily(model: nn.Module, kind: StateDictType, config, optim) -> Iterator[None]:
    """Run with ``kind`` and the given configs (the caller's settings come back after)."""
    with state_dict_type(model, kind, config, optim):
        yield


# ------------------------------------------------------------- optimizer state
def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, under ``model``'s settings.

    ``optim_state_dict`` (torch: an ``optim.state_dict()`` already taken) must be ``None``:
    the state is read from ``optim``. ``group`` must be ``None``: groups come from the model.
    """
    _no_group("optim_state_dict", group)
    if optim_state_dict is not None:
        raise ValueError(
            "optim_state_dict: passing optim.state_dict() is not supported; shardwrap reads "
            "the state from optim itself (pass optim_state_dict=None)"
        )
    settings = get_state_dict_type(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    rank0_only = full and getattr(settings.optim_state_dict_config, "rank0_only", False)
    model_cfg = FullStateDictConfig() if full else ShardedStateDictConfig()
    with _temporarily(model, settings.state_dict_type, model_cfg, settings.optim_state_dict_config):
        result = _sd.optim_state_dict(model, optim)
    if rank0_only and model_slots(model).world_comm.rank != 0:
        return {}
    if settings.optim_state_dict_config.offload_to_cpu:
        result = _map_tensors(result, lambda t: t.cpu())
    return result


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict | None,
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    """``optim.load_state_dict``'s argument for this rank, from a name-keyed state dict.

    Under ``FullOptimStateDictConfig(rank0_only=True)`` only world rank 0's
    ``optim_state_dict`` is read; the other ranks may pass ``None`` or ``{}``.
    """
    _no_group("optim_state_dict_to_load", group)
    if is_named_optimizer:
        raise ValueError("optim_state_dict_to_load: is_named_optimizer=True is not supported")
    settings = get_state_dict_type(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    if full and getattr(settings.optim_state_dict_config, "rank0_only", False):
        optim_state_dict = broadcast_from_rank0(model_slots(model).world_comm, optim_state_dict)
    _check_given("optim_state_dict", optim_state_dict)
    return _sd.optim_state_dict_to_load(
        model, optim, names_keyed(optim_state_dict, model), load_directly=load_directly
    )


def broadcast_from_rank0(comm: Communicator, osd: dict | None) -> dict:
    """Rank 0's ``osd`` on every rank: its layout as one object, then tensor by tensor."""
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
        return value

    layout = _map_tensors(osd, strip) if comm.rank == 0 else None
    if comm.rank == 0:
        _check_given("optim_state_dict (rank 0)", osd)
    layout = comm.all_gather_object(layout, purpose="optim_state_layout")[0]
    received: dict[int, torch.Tensor] = {}
    for slot in _slots_in(layout):
        if comm.rank == 0:
            tensor = tensors[slot.index].detach().clone()
        else:
            tensor = torch.empty(slot.shape, dtype=slot.dtype)
        comm.broadcast(tensor, src_rank=0, purpose="optim_state_dict").wait()
        received[slot.index] = tensor
    return _map_tensors(
        layout, lambda s: received[s.index], leaf=lambda v: isinstance(v, _TensorSlot)
    )


class _TensorSlot:
    """A tensor's place in a broadcast layout (picklable, small)."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _slots_in(value: Any) -> list[_TensorSlot]:
    found: list[_TensorSlot] = []
    _map_tensors(value, lambda s: found.append(s) or s, leaf=lambda v: isinstance(v, _TensorSlot))
    return sorted(found, key=lambda s: s.index)


def _map_tensors(value: Any, fn, leaf=lambda v: isinstance(v, torch.Tensor)) -> Any:
    """``value`` (dicts, lists, tuples) with ``fn`` applied to every leaf."""
    if leaf(value):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn, leaf) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, fn, leaf) for v in value)
    return value


def _check_given(argument: str, osd: Any) -> None:
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ValueError(
            f"{argument}: expected a dict with 'state' and 'param_groups', got "
            f"{type(osd).__name__ if not isinstance(osd, dict) else sorted(osd)}; with "
            "rank0_only only rank 0 needs one"
        )


def _no_group(method: str, group: Any) -> None:
    if group is not None:
        raise ValueError(f"{method}: group= is not supported; process groups come from the model")


# --------------------------------------------------------- FSDP1's legacy calls
def _legacy(name: str, replacement: str) -> None:
    warnings.warn(
        f"FullyShardedDataParallel.{name} is deprecated in torch (as in shardwrap); use "
        f"{replacement} instead",
        FutureWarning,
        stacklevel=3,
    )


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Any = None,
    rank0_only: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    """Whole optimizer state keyed by parameter name (``rank0_only``: ``{}`` elsewhere).

    ``optim_input`` (deprecated in torch) changes nothing: names come from ``optim``
    (given, it warns once).
    """
    _legacy("full_optim_state_dict", "optim_state_dict")
    if optim_input is not None:
        warn_once(
            "full_optim_state_dict(optim_input=...)",
            "not acted on: parameter names and order come from the optimizer's own groups",
        )
    config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
    with _temporarily(model, StateDictType.FULL_STATE_DICT, None, config):
        return optim_state_dict(model, optim, group=group)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
) -> dict[str, Any]:
    """This rank's pieces of the optimizer state keyed by parameter name."""
    _legacy("sharded_optim_state_dict", "optim_state_dict")
    with _temporarily(model, StateDictType.SHARDED_STATE_DICT, None, None):
        return optim_state_dict(model, optim, group=group)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """``optim.load_state_dict``'s argument for this rank from a full state dict (every rank
    passes it; keyed by name, or by parameter ID as ``rekey_optim_state_dict`` makes it)."""
    _legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
    osd = names_keyed(full_optim_state_dict, model, optim_input)
    return _to_load(model, optim, osd, StateDictType.FULL_STATE_DICT)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict | None,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """As :func:`shard_full_optim_state_dict`, but only rank 0 passes the full state dict
    (the others pass ``None``); it reaches them by broadcast."""
    _legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _no_group("scatter_full_optim_state_dict", group)
    comm = model_slots(model).world_comm
    if comm.rank == 0:
        full_optim_state_dict = names_keyed(full_optim_state_dict, model, optim_input)
    osd = broadcast_from_rank0(comm, full_optim_state_dict)
    return _to_load(model, optim, osd, StateDictType.FULL_STATE_DICT)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict, model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optim.load_state_dict``'s argument from :func:`sharded_optim_state_dict`'s result."""
    _legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    return _to_load(model, optim, sharded_optim_state_dict, StateDictType.SHARDED_STATE_DICT)


def _to_load(model, optim, osd: dict, kind: StateDictType) -> dict[str, Any]:
    _check_given("optim_state_dict", osd)
    target = optim if optim is not None else _optimizer_like(model, osd)
    with _temporarily(model, kind, None, None):
        return _sd.optim_state_dict_to_load(model, target, osd)


def _optimizer_like(model: nn.Module, osd: dict) -> SimpleNamespace:
    """Without ``optim``: one built over the saved groups' parameters, in model order."""
    slots = model_slots(model).by_name()
    order = {name: i for i, name in enumerate(slots)}
    groups = []
    for saved in osd["param_groups"]:
        names = sorted(saved["params"], key=lambda n: order.get(n, len(order)))
        missing = [n for n in names if n not in slots]
        if missing:
            raise ValueError(f"optim_state_dict: parameters {missing} are not in the model")
        settings = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**settings, "params": [slots[n].local for n in names]})
    # Its settings are the saved ones, so there are no defaults to check them against.
    return SimpleNamespace(param_groups=groups, defaults={})
