"""Dynamic loss scaling for fp16 training of sharded models.

Each rank holds only its shard of the reduced gradients, so an inf/NaN may be visible on
one rank alone. ``unscale_`` therefore combines the "found inf" flag over all ranks (MAX)
before anyone decides, and every rank skips (or takes) the step together. The scale
arithmetic follows ``torch.amp.GradScaler``: the loss is multiplied by a float32 scale,
gradients by its reciprocal; an overflow multiplies the scale by ``backoff_factor``,
``growth_interval`` clean steps in a row multiply it by ``growth_factor``.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist

from ..base.torch_compat import tree_map
from ..base.validate import check_int
from ..comm import collectives
from ..comm.collectives import CommLedger, Communicator
from ..runtime.deferred_grads import reduce_deferred_grads_for


class _OptimizerStage(enum.Enum):
    READY = "READY"  # gradients still scaled
    UNSCALED = "UNSCALED"  # unscale_ ran; found_inf decided
    STEPPED = "STEPPED"  # step() ran (or was skipped) since the last update()


class ShardedGradScaler:
    """``torch.amp.GradScaler`` for ``ShardedModule``: one skip decision for all ranks."""

    def __init__(
        self,
        device: str = "cpu",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale: must be positive, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor: must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor: must be in (0, 1), got {backoff_factor}")
        check_int("growth_interval", growth_interval, minimum=1)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected a bool, got {enabled!r}")
        self.device = torch.device(device)
        self.enabled = enabled
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self._scale = float(init_scale)
        self._growth_tracker = 0  # clean steps since the last change of scale
        group = process_group if process_group is not None else collectives.default_group()
        self.comm_ledger = CommLedger()
        self._comm = Communicator(group, self.comm_ledger)
        self._stage: dict[int, _OptimizerStage] = {}  # by id(optimizer), since update()
        self._found_inf: dict[int, bool] = {}

    def is_enabled(self) -> bool:
        return self.enabled

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, outputs: Any) -> Any:
        """Multiply floating tensors in ``outputs`` by the scale (as float32, like torch)."""
        if not self.enabled:
            return outputs
        scale = torch.tensor(self._scale, dtype=torch.float32)

        def multiply(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x * scale.to(x.device)
            return x

        return tree_map(multiply, outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale; decide found_inf across all ranks."""
        if not self.enabled:
            return
        key = id(optimizer)
        if self._stage.get(key, _OptimizerStage.READY) is not _OptimizerStage.READY:
            raise RuntimeError("unscale_() was already called on this optimizer since update()")
        reduce_deferred_grads_for(optimizer)  # ZeRO-1 gradients left by no_sync backwards
        inverse = 1.0 / self._scale
        local_inf = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not bool(torch.isfinite(param.grad).all()):
                        local_inf = True
                    param.grad.mul_(inverse)
        flag = torch.tensor([float(local_inf)])
        self._comm.all_reduce(flag, purpose="found_inf", op=dist.ReduceOp.MAX).wait()
        self._found_inf[key] = bool(flag.item())
        self._stage[key] = _OptimizerStage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and step unless any rank found an inf/NaN gradient."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        key = id(optimizer)
        if self._stage.get(key) is _OptimizerStage.STEPPED:
            raise RuntimeError("step() was already called on this optimizer since update()")
        if self._stage.get(key, _OptimizerStage.READY) is _OptimizerStage.READY:
            self.unscale_(optimizer)
        self._stage[key] = _OptimizerStage.STEPPED
        if self._found_inf[key]:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adjust the scale from this iteration's found_inf (the same on every rank)."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("update(): no unscale_() or step() ran since the last update()")
        if any(self._found_inf.values()):
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._stage.clear()
        self._found_inf.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
