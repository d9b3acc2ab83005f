"""``deepspeed.zero`` for ``import shardwrap as deepspeed``: ``Init`` and ``GatheredParameters``.

[Note: zero.Init builds the model as usual]
DeepSpeed's ``zero.Init`` partitions each parameter as the model's ``__init__`` creates it,
so a model larger than one device's memory can be built. shardwrap's way to that end is a
model built on the meta device and materialised unit by unit when it is wrapped
(``ShardedModule(param_init_fn=...)``, docs/training.md). Building on meta inside ``Init``
would silently drop any initialisation the model's ``__init__`` does beyond
``reset_parameters`` (Hugging Face's ``post_init``, a custom ``nn.init``), so ``Init`` here
takes DeepSpeed 0.19.8's arguments (an unknown keyword is a ``TypeError``, as there) and
builds the model as usual: every rank holds the whole model until ``initialize`` shards
it, and the weights are exactly those of a build without ``Init``. Because that is not
what ``Init`` asks for, entering it warns once, and each argument that asks for something
more (a remote device, a dtype, a group) warns once, naming what shardwrap does instead
([Note: accepted but not acted on]). ``enabled=False`` and ``mem_efficient_linear=False``
ask for what is done, and ``mpu`` is refused, as ``initialize`` refuses it.

``GatheredParameters(params, modifier_rank=None)`` shows the full parameters of the units
that hold ``params`` inside the block (``summon_full_params`` on those units), read the
module attributes (``model.layer.weight``) inside the block to see them; with
``modifier_rank`` set, that rank's values are broadcast and written back into every
rank's shard on exit, otherwise edits are dropped. Every rank must enter it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..base.validate import check_bool
from ..base.warn_once import warn_once
from ..core.unit import Unit
from ..features.summon import summon_full_params
from ..runtime import registry

# Init's arguments that ask for something shardwrap does not do, and what it does instead.
_INIT_INSTEAD = {
    "module": "the module is sharded when initialize wraps it",
    "data_parallel_group": "initialize shards over the default process group",
    "remote_device": "offload comes from the config's offload_param / offload_optimizer",
    "pin_memory": "host shards are page-locked whenever CUDA is available",
    "config_dict_or_path": "the config passed to initialize is the one read",
    "config": "the config passed to initialize is the one read",
    "dtype": "parameters keep the dtype they are built in; the config's bf16 / fp16 block "
    "sets the compute dtype",
    "zero_param_parallel_group": "use the config's zero_hpz_partition_size",
    "zero_quantized_weights": "use the config's zero_quantized_weights",
    "zero_quantized_nontrainable_weights": "frozen weights are gathered unquantized",
    "sequence_data_parallel_group": "there is no sequence parallelism",
    "param_swapper": "nvme offload comes from the config's offload_param",
    "tensor_overrides": "tensors are created as torch creates them",
}


class Init(contextlib.ContextDecorator):
    """DeepSpeed's ``zero.Init``: builds the model as usual, and says so once.

    See [Note: zero.Init builds the model as usual].
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        self.module = module
        self.enabled = check_bool("enabled", enabled)
        self.dtype = dtype
        check_bool("mem_efficient_linear", mem_efficient_linear)  # False: what is done
        if mpu is not None:
            raise ValueError("zero.Init: mpu (model parallelism) is not supported")
        given = {
            "module": module,
            "data_parallel_group": data_parallel_group,
            "remote_device": None if remote_device in (None, "none") else remote_device,
            "pin_memory": check_bool("pin_memory", pin_memory) or None,
            "config_dict_or_path": config_dict_or_path,
            "config": config,
            "dtype": dtype,
            "zero_param_parallel_group": zero_param_parallel_group,
            "zero_quantized_weights": zero_quantized_weights or None,
            "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights or None,
            "sequence_data_parallel_group": sequence_data_parallel_group,
            "param_swapper": param_swapper,
            "tensor_overrides": tensor_overrides,
        }
        self.not_acted_on = [name for name, value in given.items() if value is not None]
        if self.enabled:
            _warn_init(self.not_acted_on)

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def _warn_init(not_acted_on: list[str]) -> None:
    warn_once(
        "zero.Init",
        "the model is built as usual (every rank holds it whole) and sharded when "
        "initialize wraps it; for a model too large for that, build it under "
        "torch.device('meta') (docs/training.md, deferred initialisation)",
    )
    for name in not_acted_on:
        warn_once(f"zero.Init({name}=...)", f"not acted on: {_INIT_INSTEAD[name]}")


def _units_holding(params: list[torch.Tensor]) -> list[tuple[nn.Module, Unit]]:
    """The wrapped units whose handles hold any of ``params`` (in wrap order)."""
    wanted = {id(p) for p in params}
    found = []
    for module, unit in registry.managed_units():
        handle = unit.handle
        if handle is None:
            continue
        if any(id(p) in wanted for p in [*handle.shard_params, *handle.shown_params()]):
            found.append((module, unit))
    return found


@contextlib.contextmanager
def GatheredParameters(  # noqa: N802 - DeepSpeed's name
    params: torch.Tensor | Iterable[torch.Tensor],
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """Full parameters inside the block; ``modifier_rank``'s edits kept (see the module doc).

    ``fwd_module`` is not needed: a unit gathers the parameters it holds, wherever they
    are used; giving one warns once.
    """
    if fwd_module is not None:
        warn_once(
            "GatheredParameters(fwd_module=...)",
            "not acted on: shardwrap gathers parameters by the unit that holds them, so "
            "there are no external parameters to register",
        )
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p is not None]
    units = _units_holding(params) if enabled else []
    if not units:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module, _ in units:
            stack.enter_context(
                summon_full_params(module, recurse=False, writeback=modifier_rank is not None)
            )
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for _, unit in units:
                    world = registry.runtime_of(unit).world_comm
                    for shown in unit.handle.shown_params():
                        work = world.broadcast(
                            shown.data, src_rank=modifier_rank, purpose="gathered_parameters"
                        )
                        work.wait()
