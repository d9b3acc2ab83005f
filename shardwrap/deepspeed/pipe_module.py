"""DeepSpeed's ``PipelineModule`` and ``LayerSpec``: a model as a list of layers, in stages.

``PipelineModule(layers=[...], num_stages=N, loss_fn=...)`` splits ``layers`` into ``N``
contiguous stages and builds only this rank's: its layers are registered under their
index in ``layers`` (``"3.weight"``), as DeepSpeed names them, which are also the names
of ``nn.Sequential(*layers)``, so checkpoints move between the two. World rank ``r``
runs stage ``r // (world / N)`` (DeepSpeed's pipe-major topology). ``shardwrap.initialize``
turns it into an engine whose ``train_batch`` drives torch's pipeline schedule over the
stages, each sharded with ZeRO-1/2/3 over its data-parallel group
([Note: ZeRO inside pipeline stages] in ``features/pipeline_stage.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm import collectives

PARTITION_METHODS = ("parameters", "uniform")


def balanced_partition(weights: Sequence[int], num_parts: int) -> list[int]:
    """Boundaries ``b`` (``num_parts + 1`` of them, ``b[0] = 0``, ``b[-1] = len(weights)``)
    of contiguous, non-empty parts whose largest total weight is as small as possible.

    Among the optimal splits, parts are made as early as possible (greedy fill up to the
    optimal bound, leaving at least one item per later part).
    """
    count = len(weights)
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_stages: expected a positive int, got {num_parts!r}")
    if count < num_parts:
        raise ValueError(
            f"num_stages: {num_parts} stages need at least as many layers, got {count}"
        )
    if any(w < 0 for w in weights):
        raise ValueError("weights: must be non-negative")
    low, high = max(weights, default=0), sum(weights)
    while low < high:  # the smallest bound that some split meets
        middle = (low + high) // 2
        if _fits(weights, num_parts, middle):
            high = middle
        else:
            low = middle + 1
    return _greedy(weights, num_parts, low)


def _fits(weights: Sequence[int], num_parts: int, bound: int) -> bool:
    parts, total = 1, 0
    for weight in weights:
        if total + weight > bound:
            parts, total = parts + 1, 0
        total += weight
    return parts <= num_parts


def _greedy(weights: Sequence[int], num_parts: int, bound: int) -> list[int]:
    bounds, total = [0], 0
    for index, weight in enumerate(weights):
        later_parts = num_parts - len(bounds)  # parts still to open after the current one
        must_close = len(weights) - index == later_parts
        if later_parts > 0 and index > bounds[-1] and (total + weight > bound or must_close):
            bounds.append(index)
            total = 0
        total += weight
    bounds.append(len(weights))
    return bounds


class LayerSpec:
    """A layer built only on the stage that runs it: ``LayerSpec(Cls, *args, **kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"typename: expected an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class _Function(nn.Module):
    """A plain callable in ``layers`` (DeepSpeed allows them), as a parameterless layer."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _layer_weight(layer: Any, method: str) -> int:
    if method == "uniform":
        return 1
    if isinstance(layer, LayerSpec):
        layer = layer.build()  # DeepSpeed builds specs to count them too
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


class PipelineModule(nn.Module):
    """This rank's stage of ``layers`` (DeepSpeed's arguments; see the module docstring).

    Supported: ``layers`` (modules, ``LayerSpec``s, plain callables), ``num_stages``,
    ``loss_fn(outputs, labels)``, ``partition_method`` ``"parameters"`` (balance trainable
    parameter counts, DeepSpeed's default) or ``"uniform"`` (balance layer counts).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        _refuse(topology, seed_layers, activation_checkpoint_interval, unsupported)
        if not collectives.is_initialized():
            raise RuntimeError(
                "PipelineModule: initialize torch.distributed first "
                "(shardwrap.init_distributed(), as deepspeed.init_distributed())"
            )
        if not isinstance(partition_method, str) or partition_method.lower() not in (
            PARTITION_METHODS
        ):
            raise ValueError(
                f"partition_method: expected one of {list(PARTITION_METHODS)}, "
                f"got {partition_method!r}"
            )
        specs = list(layers)
        world = collectives.world_size()
        if num_stages is None or isinstance(num_stages, bool) or not isinstance(num_stages, int):
            raise ValueError(f"num_stages: expected a positive int, got {num_stages!r}")
        if num_stages < 1 or world % num_stages:
            raise ValueError(f"num_stages: {num_stages} must divide the world size {world}")
        weights = [_layer_weight(layer, partition_method.lower()) for layer in specs]
        self.parts = balanced_partition(weights, num_stages)
        self.num_stages = num_stages
        self.data_parallel_size = world // num_stages
        self.stage_id = collectives.world_rank() // self.data_parallel_size
        self.loss_fn = loss_fn
        start, stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        for index in range(start, stop):
            self.add_module(str(index), _built(specs[index]))

    def forward(self, x: Any) -> Any:
        for layer in self.children():
            x = layer(x)
        return x


def _built(layer: Any) -> nn.Module:
    if isinstance(layer, LayerSpec):
        return layer.build()
    if isinstance(layer, nn.Module):
        return layer
    if callable(layer):
        return _Function(layer)
    raise TypeError(f"layers: expected modules, LayerSpecs or callables, got {layer!r}")


def _refuse(topology: Any, seed_layers: Any, interval: Any, unsupported: dict) -> None:
    if topology is not None:
        raise ValueError("topology: not supported; give num_stages (pipe x data topology)")
    if seed_layers:
        raise ValueError("seed_layers: not supported; seed torch before building the model")
    if interval:
        raise ValueError("activation_checkpoint_interval: not supported inside stages")
    if unsupported:
        raise ValueError(f"PipelineModule: unsupported arguments {sorted(unsupported)}")
