"""Every ``ShardedModule`` argument is acted on, refused, or warned about (on 2 ranks).

The arguments come from the constructor's signature; each one is set, alone, to a value
other than its default, and the wrapped model must show it: an effect on what was built
(the units, their groups, dtypes, shard storage and ZeRO++ state, the schedule, the
collectives issued while wrapping, the parameters), a ``UserWarning`` naming the
argument, or an error naming it. The options the constructor merely stores (FSDP1's
attribute names) are deliberately not part of the effect, so an argument that is stored
and never used shows as silent. Two ranks, since on one some arguments rightly do
nothing (``sync_module_states`` has no peer, ZeRO++ no bytes to save). Negative control:
with the warnings of the arguments shardwrap does not act on switched off, the check
reports exactly those.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from shardwrap import wrap
from shardwrap.assemble.root import root_of
from shardwrap.base.warn_once import forget_warned
from shardwrap.options import BackwardPrefetch, CommQuantization, CPUOffload, MixedPrecision
from tests import models
from tests.dist.harness import run_ranks

# A value other than the default for each argument, built for the model about to be wrapped.
NON_DEFAULT: dict[str, Callable[[nn.Module], Any]] = {
    "process_group": lambda model: dist.new_group([0, 1]),
    "sharding_strategy": lambda model: "SHARD_GRAD_OP",
    "cpu_offload": lambda model: CPUOffload(offload_params=True),
    "auto_wrap_policy": lambda model: wrap.ModuleWrapPolicy({nn.Linear}),
    "backward_prefetch": lambda model: BackwardPrefetch.BACKWARD_POST,
    "mixed_precision": lambda model: MixedPrecision(param_dtype=torch.bfloat16),
    "ignored_modules": lambda model: [model.head],
    "param_init_fn": lambda model: lambda module: None,
    "device_id": lambda model: torch.device("meta"),
    "sync_module_states": lambda model: True,
    "forward_prefetch": lambda model: True,
    "limit_all_gathers": lambda model: False,
    "use_orig_params": lambda model: False,
    "ignored_states": lambda model: [model.head],
    # a slice of a 2-D mesh, each rank alone (a mesh over both ranks has the default group)
    "device_mesh": lambda model: init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["tp"],
    "param_persistence_threshold": lambda model: 10**9,
    "comm_quantization": lambda model: CommQuantization(weights=True, gradients=True),
}


def _effects(model: shardwrap.ShardedModule) -> dict:
    """What wrapping built and did, leaving out the options it only stores."""
    schedule = root_of(model).runtime.schedule
    units = []
    for unit in model.units:
        handle = unit.handle
        built = None
        if handle is not None:
            built = (
                tuple(info.fqn for info in handle.layout.params),
                handle.num_shards,
                id(handle.shard_comm.group),
                handle.replicate_comm is not None,
                handle.compute_dtype,
                handle.reduce_dtype,
                type(handle.host_staging).__name__,
                handle.grads.reduces_in_place,
                handle.comm_quant is not None,
                handle.flat_shard.device.type,
            )
        units.append((type(unit.module).__name__, unit.strategy, built))
    return {
        "schedule": (
            schedule.forward_prefetch,
            schedule.backward_prefetch,
            schedule.reduce_bucket_bytes,
            schedule.all_gather_bucket_bytes,
        ),
        "units": units,
        "wrap collectives": [(r.kind, r.purpose) for r in model.comm_ledger.records],
        "parameters": [(n, p.dtype, p.device.type) for n, p in model.named_parameters()],
        "disk": model.disk_store is not None,
    }


def _wrap(**kwargs: Any) -> tuple[dict | None, list[str], Exception | None]:
    forget_warned()
    torch.manual_seed(0)
    model = models.TinyGPT()
    values = {name: make(model) for name, make in kwargs.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            wrapped = shardwrap.ShardedModule(model, **values)
        except (TypeError, ValueError, RuntimeError) as error:
            return None, [], error
    return _effects(wrapped), [str(w.message) for w in caught], None


def _silent_arguments() -> list[str]:
    reference, _, error = _wrap()
    assert error is None, error
    silent = []
    for name in inspect.signature(shardwrap.ShardedModule.__init__).parameters:
        if name in ("self", "module"):
            continue
        if name not in NON_DEFAULT:
            silent.append(f"{name} (no non-default value known to this test)")
            continue
        effects, messages, error = _wrap(**{name: NON_DEFAULT[name]})
        if error is not None:
            shown = name in str(error)
        else:
            shown = effects != reference or any(name in m for m in messages)
        if not shown:
            silent.append(name)
    return silent


def _silent_worker(rank: int, world_size: int, lose_warnings: bool) -> list[str]:
    original = wrap.note_unused_args
    if lose_warnings:  # the negative control: these arguments would be dropped silently
        wrap.note_unused_args = lambda **kwargs: None
    try:
        return _silent_arguments()
    finally:
        wrap.note_unused_args = original


def test_every_argument_is_acted_on_or_warned():
    assert run_ranks(_silent_worker, 2, False) == [[], []]


def test_negative_control_arguments_whose_warning_is_lost_are_caught():
    lost = ["limit_all_gathers", "use_orig_params"]
    assert run_ranks(_silent_worker, 2, True) == [lost, lost]


def _agreement_worker(rank: int, world_size: int) -> str:
    forget_warned()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = shardwrap.ShardedModule(models.TinyGPT(), limit_all_gathers=rank == 0)
    models.gpt_loss(model, models.gpt_batch(rank)).backward()
    return " | ".join(str(w.message) for w in caught)


def test_ranks_that_differ_in_limit_all_gathers_agree():
    # it changes no collective, so it is not in the agreement digest; rank 1 is warned
    messages = run_ranks(_agreement_worker, 2)
    assert "limit_all_gathers" not in messages[0]
    assert "limit_all_gathers=False" in messages[1] and "not acted on" in messages[1]
