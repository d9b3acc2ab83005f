"""Every private torch API shardwrap uses, in one place, each with what it is for.

When a torch upgrade moves one of these, this module is the only one to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "fsdp2_reduces_in_param_dtype_by_default",
    "fsdp2_translates_spmd_types",
    "dtensor_of",
    "fsdp1_training_states",
    "in_backward",
    "preserve_version_counter",
    "queue_backward_callback",
    "sharded_spec",
    "storage_use_count",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]


def fsdp2_reduces_in_param_dtype_by_default() -> bool:
    """Whether this torch's FSDP2 reduces gradients in ``MixedPrecisionPolicy.param_dtype``
    when ``reduce_dtype`` is None (before 2.15), rather than in the parameter's own dtype
    (2.15 on: the policy's docs, "versionchanged:: 2.15")."""
    return torch.torch_version.TorchVersion(torch.__version__) < (2, 15)


def fsdp2_translates_spmd_types() -> bool:
    """Whether this torch's ``fully_shard`` with ``dp_mesh_dims`` takes plain parameters
    annotated with spmd_types local types and makes DTensors of them (2.14 on), rather than
    taking DTensor parameters only (2.13)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 14)


def fsdp2_reset_drops_gradients() -> bool:
    """Whether this torch's FSDP2 ``reset_iter_state`` drops every gradient of the failed
    step (2.15 on: the sharded ``.grad`` and the unreduced local gradients), rather than
    keeping the local gradients of the units not yet reduced (before 2.15)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 15)


def fsdp1_training_states() -> type:
    """torch's FSDP1 ``TrainingState`` enum (``IDLE``, ``FORWARD_BACKWARD``,
    ``SUMMON_FULL_PARAMS``): what FSDP1's ``training_state`` holds and ``_assert_state``
    takes, so code comparing with torch's members gets answers from ours."""
    from torch.distributed.fsdp._common_utils import TrainingState

    return TrainingState


def preserve_version_counter(tensor: torch.Tensor) -> Any:
    """A context in which writes to ``tensor`` leave its version counter as it was.

    The gathered buffer is written in place by collectives; autograd must not see those
    writes as modifications of tensors it saved.
    """
    return torch.autograd._unsafe_preserve_version_counter(tensor)


def in_backward() -> bool:
    """Whether this thread is inside an autograd backward pass now (FSDP2 refuses to
    change its backward finalization mode there)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass is over (autograd's own queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# Counts the tensors (and the Python storage object) sharing a storage; ``None`` where this
# torch lacks it (then nothing is reused, which is slower but correct).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """How many tensors (plus the Python storage object) share ``storage``; ``None`` when
    this torch cannot tell."""
    if _storage_use_count is None:
        return None
    return _storage_use_count(storage._cdata)


def sharded_spec(
    mesh: Any, placements: tuple, shape: tuple[int, ...], stride: tuple[int, ...], dtype: Any
) -> Any:
    """The layout record of a global ``shape``/``stride`` tensor of ``dtype`` placed on
    ``mesh`` (torch's private ``DTensorSpec``), built once for :func:`dtensor_of` to reuse."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def dtensor_of(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``spec`` says, with no autograd record and no
    checks: what ``DTensor.from_local(..., run_check=False)`` gives for a ``local`` already
    on the mesh's device type (from_local would move it there), for a fraction of its CPU
    (it builds the spec and runs an autograd function per call, about 0.1 ms, and a step
    wraps every gradient). torch's own FSDP2 wraps its gradients the same way."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)
