"""``ShardedPipelineStage``: torch's ``PipelineStage`` for a stage wrapped in ``ShardedModule``.

[Note: ZeRO inside pipeline stages]
Each pipeline stage's module is wrapped in its own ``ShardedModule`` over the stage's
data-parallel group (``process_group=`` or ``device_mesh=mesh["dp"]``), and torch's
schedules (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ...) drive
it. torch's stage knows DDP and FSDP2 by their classes and calls FSDP2's controls (and
its internals) on them; this subclass makes the same calls on a ``ShardedModule``
through its FSDP2-named methods ([Note: microbatched steps] in ``runtime/step.py``):

* before every forward: ``set_is_last_backward(False)`` (the step goes on);
* before each microbatch's backward but the last: no gradient sync, no reshard after
  backward, not the last backward; before the last one: all three on, so that backward
  reduces every unit's gradients, summed over the step's microbatches, once, overlapped
  with the rest of that backward (as DDP's reducer under torch's stage);
* ``perform_reduce_grad`` (after the last backward): only torch's scaling by the number
  of microbatches is left to do.

ZeRO-3 (``FULL_SHARD``) units are gathered for each microbatch's forward and kept from
the step's first backward to its last (FSDP2's behaviour under these schedules); with
``set_reshard_after_forward(False, root_only=False)`` on the stage module they are
gathered once per step. Zero-bubble schedules, which split backward into input and
weight passes, are refused.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage

from ..assemble.root import is_root


class ShardedPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose ``submodule`` is a ``ShardedModule`` (its arguments are
    torch's); use it wherever torch's schedules take a ``PipelineStage``."""

    def __init__(self, submodule: Any, stage_index: int, num_stages: int, device: Any, **kw):
        if not is_root(submodule):
            raise TypeError(
                f"submodule: expected a ShardedModule (the stage's module wrapped over its "
                f"data-parallel group), got {type(submodule).__name__}"
            )
        super().__init__(submodule, stage_index, num_stages, device, **kw)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        self.submod.set_is_last_backward(False)
        return self.submod(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if backward_type != "full":
            raise NotImplementedError(
                f"ShardedPipelineStage: a {backward_type!r} backward (zero-bubble schedules "
                "split backward into input and weight passes) is not supported; use "
                "ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B"
            )
        module = self.submod
        module.set_requires_gradient_sync(last_backward)
        module.set_reshard_after_backward(last_backward)
        module.set_is_last_backward(last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """Without ``input_args``/``output_args`` the stage learns what flows back from one
        real backward for input gradients only: no parameter gets a gradient, so there is
        nothing to reduce over the data-parallel group (with sync on, every unit would
        reduce an empty gradient once more in the first step)."""
        self.submod.set_requires_gradient_sync(False)
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.set_requires_gradient_sync(True)

    def _post_metadata_inference_cleanup(self) -> None:
        """Metadata inference ran one real forward (and input backward): drop its grads."""
        super()._post_metadata_inference_cleanup()
        module = self.submod
        module.set_is_last_backward(True)
        for param in module.parameters():
            param.grad = None
