"""Meta-device initialisation behind the FSDP2 door, as FSDP2 client code does it.

[Note: meta-device modules on the FSDP2 door]
FSDP2 code builds the model under ``torch.device("meta")``, calls ``fully_shard`` on each
block and then the root, then ``model.to_empty(device=...)`` and initialises in place on
the sharded ``DTensor`` parameters (``model.apply(init_fn)``, ``reset_parameters()``).
Every init op runs on each rank's local chunk: on a CPU mesh DTensor has no RNG tracker
(``torch.cpu`` has no ``set_rng_state``, so ``is_rng_supported_mesh`` is False) and each
rank draws its chunk from its own default generator, in the order the init ops run.
The door's views have FSDP2's local shapes ([Note: DTensor shard views]), so the same
ops on the same generator give the same values bit for bit.

Here ``fully_shard`` gives a call's meta parameters and buffers zeroed CPU storage first
(one unit's full size, held until its handle has copied its shard out; FSDP2 allocates
nothing before ``to_empty``), so the engine builds the unit as for any CPU module.

``nn.Module._apply`` (under ``to_empty``, ``to``, ``float``) would then swap each DTensor
parameter's contents for ``fn(param)``'s (``torch.utils.swap_tensors``, as it does for
every wrapper subclass): new storage, leaving the engine's flat shard behind, so an init
written there never reaches the all-gather. ``FSDPModule._apply`` therefore hides the
unit's shard views from ``nn.Module._apply`` and runs ``fn`` on each itself, copying the
result's local tensor into the view; the parameter objects and their storage (the flat
shard) stay what the engine and the optimizer hold. A conversion that changes a shard's
dtype or device is refused: the flat shard has one of each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..flat_param import FlatParamHandle


def materialize_meta(members: list[nn.Module]) -> None:
    """Give the meta parameters and buffers under ``members`` zeroed CPU storage, keeping
    tied parameters tied ([Note: meta-device modules on the FSDP2 door])."""
    made: dict[int, torch.Tensor] = {}
    for member in members:
        for module in member.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is not None and tensor.is_meta:
                        table[name] = made.setdefault(id(tensor), _zeros_like(tensor))


def _zeros_like(tensor: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros(tensor.shape, dtype=tensor.dtype, device="cpu")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(zeros, requires_grad=tensor.requires_grad)
    return zeros


def apply_to_shards(handle: FlatParamHandle, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Run ``nn.Module._apply``'s ``fn`` on ``handle``'s shard views, writing the results
    into the views (the flat shard) in place."""
    flat = handle.flat_shard
    with torch.no_grad():
        for index, param in enumerate(handle.shard_params):
            result = fn(param)
            local = result.to_local() if isinstance(result, DTensor) else result
            view = param.to_local() if isinstance(param, DTensor) else param
            if local.dtype != flat.dtype or local.device != flat.device:
                info = handle.layout.params[index]
                raise NotImplementedError(
                    f"module: converting parameter {info.fqn!r} from {flat.dtype} on "
                    f"{flat.device} to {local.dtype} on {local.device} after fully_shard is "
                    "not yet supported by shardwrap.fully_shard; convert before it"
                )
            if local is not view:
                view.copy_(local)


def hide_shards(handle: FlatParamHandle) -> None:
    """Take ``handle``'s shard views off the module (``nn.Module._apply`` skips None)."""
    handle.show_params([None] * len(handle.shard_params))  # type: ignore[list-item]
