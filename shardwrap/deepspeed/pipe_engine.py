"""DeepSpeed's pipeline engine: ``initialize`` on a ``PipelineModule``, then ``train_batch``.

DeepSpeed's own pipeline engine refuses ZeRO-2 and ZeRO-3 ("incompatible with pipeline
parallelism"); here every ZeRO stage runs inside every pipeline stage. Each rank's
``PipelineModule`` (its stage's layers) is wrapped in a ``ShardedModule`` over the stage's
data-parallel group, with ``zero_optimization.stage``'s strategy, and torch's
``Schedule1F1B`` drives the stages ([Note: ZeRO inside pipeline stages] in
``features/pipeline_stage.py``). One ``train_batch`` is one optimizer step over
``gradient_accumulation_steps`` micro-batches; gradient clipping uses the norm over all
stages; the loss it returns is the mean over the micro-batches and data-parallel ranks,
on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.pipelining import Schedule1F1B

from ..assemble.root import root_of
from ..comm import collectives, launch
from ..comm.collectives import Communicator
from ..features.grad_clip import sharded_grad_norm
from ..features.pipeline_stage import ShardedPipelineStage
from ..planner.estimate import STAGE_STRATEGIES
from ..policies import lambda_auto_wrap_policy
from ..wrap import ShardedModule
from . import top_level_api
from .config import DeepSpeedConfig
from .engine import ShardedEngine
from .engine_parts import (
    apply_buckets,
    attach_optimizer,
    build_scheduler,
    comm_quantization_of,
    mixed_precision_of,
)
from .pipe_module import PipelineModule
from .zero import OffloadDevice

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_ (and grad_clip.py)


def initialize_pipeline(model: PipelineModule, **arguments: Any):
    """``shardwrap.initialize`` for a ``PipelineModule`` (its arguments, by name)."""
    for name in ("training_data", "mpu", "mesh_param", "optimizer", "model_parameters"):
        if arguments.get(name) is not None:
            raise ValueError(
                f"{name}: not supported with a PipelineModule (give the optimizer in the config)"
            )
    config = top_level_api.config_from(
        arguments.get("args"), arguments.get("config"), arguments.get("config_params")
    )
    launch.init_distributed(dist_init_required=arguments.get("dist_init_required"))
    parsed = _checked_config(DeepSpeedConfig.load(config), model)
    pp_group, dp_group = _groups(model.num_stages, model.data_parallel_size)
    sharded = ShardedModule(
        model,
        process_group=dp_group,
        sharding_strategy=STAGE_STRATEGIES[parsed.zero_optimization.stage],
        auto_wrap_policy=arguments.get("auto_wrap_policy") or _each_layer(model),
        mixed_precision=mixed_precision_of(parsed),
        param_persistence_threshold=parsed.zero_optimization.unit_persistence_threshold,
    )
    apply_buckets(sharded, parsed.zero_optimization)
    names = {id(p): n for n, p in sharded.named_parameters()}
    optimizer = attach_optimizer(sharded, parsed, None, None, names)
    scheduler = build_scheduler(parsed, optimizer, arguments.get("lr_scheduler"))
    batch = parsed.batch_sizes(model.data_parallel_size)
    engine = PipelineEngine(sharded, optimizer, scheduler, parsed, batch, pp_group, dp_group)
    return engine, optimizer, None, scheduler


def _checked_config(parsed: DeepSpeedConfig, model: PipelineModule) -> DeepSpeedConfig:
    stages = parsed.pipeline.stages if parsed.pipeline is not None else None
    if stages is not None and stages != model.num_stages:
        raise ValueError(
            f"pipeline.stages: {stages}, but the PipelineModule has num_stages={model.num_stages}"
        )
    if parsed.fp16.enabled:
        raise ValueError("fp16: not supported with a PipelineModule (use bf16)")
    zero = parsed.zero_optimization
    devices = {zero.offload_param.device, zero.offload_optimizer.device}
    if devices != {OffloadDevice.NONE}:
        raise ValueError("zero_optimization: offload is not supported with a PipelineModule")
    if comm_quantization_of(zero) is not None:
        raise ValueError(
            "zero_optimization: ZeRO++ (zero_quantized_weights, zero_quantized_gradients, "
            "zero_hpz_partition_size) is not supported with a PipelineModule"
        )
    if model.loss_fn is None:
        raise ValueError("loss_fn: a PipelineModule for train_batch needs loss_fn")
    return parsed


def _groups(num_stages: int, dp: int):
    """This rank's pipeline group (one rank per stage) and data-parallel group (its stage's)."""
    rank = collectives.world_rank()
    pp_groups = collectives.new_subgroups([list(range(j, num_stages * dp, dp)) for j in range(dp)])
    dp_groups = collectives.new_subgroups(
        [list(range(s * dp, (s + 1) * dp)) for s in range(num_stages)]
    )
    return pp_groups[rank % dp], dp_groups[rank // dp]


def _each_layer(model: PipelineModule):
    layers = {m for m in model.children() if any(True for _ in m.parameters())}
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m in layers)


class PipelineEngine(ShardedEngine):
    """``train_batch`` over this rank's stage; the rest as :class:`ShardedEngine`."""

    def __init__(self, module, optimizer, lr_scheduler, config, batch, pp_group, dp_group):
        super().__init__(module, optimizer, lr_scheduler, config, batch)
        pipe: PipelineModule = module.module
        self.num_stages, self.stage_id = pipe.num_stages, pipe.stage_id
        self._pp_comm = Communicator(pp_group, module.comm_ledger)
        self._dp_comm = Communicator(dp_group, module.comm_ledger)
        device = next(module.parameters(), torch.empty(0)).device
        stage = ShardedPipelineStage(module, pipe.stage_id, pipe.num_stages, device, group=pp_group)
        self._stage = stage
        self._schedule = Schedule1F1B(
            stage, n_microbatches=self.gradient_accumulation_steps(), loss_fn=pipe.loss_fn
        )
        self._data_iter: Iterator | None = None

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        self._data_iter = iterator

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from
        ``data_iter`` (``(inputs, labels)`` each; read on the first and last stages);
        returns the mean loss (every rank gets it)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch: gradients must be enabled")
        if data_iter is not None:
            self._data_iter = data_iter
        inputs, labels = self._next_batch()
        losses: list[torch.Tensor] = []
        self._schedule.step(
            *((inputs,) if self.is_first_stage() else ()),
            target=labels if self.is_last_stage() else None,
            losses=losses if self.is_last_stage() else None,
        )
        self._apply_step()
        return self._mean_loss(losses)

    def _next_batch(self) -> tuple[Any, Any]:
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if self._data_iter is None:
            raise ValueError("data_iter: train_batch needs an iterator of (inputs, labels)")
        micro = [next(self._data_iter) for _ in range(self.gradient_accumulation_steps())]
        return torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])

    def _apply_step(self) -> None:
        if self.config.gradient_clipping > 0:
            self._global_grad_norm = float(self._clip(self.config.gradient_clipping))
        self.optimizer.step()
        self._step_applied = True
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
        self.global_steps += 1
        self.micro_steps += self.gradient_accumulation_steps()

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's gradients, as the whole model's would be."""
        runtime = root_of(self.module).runtime
        total, grads = sharded_grad_norm(runtime, self.module.parameters(), 2.0)
        squared = total.pow(2).reshape(1)
        self._pp_comm.all_reduce(squared, purpose="grad_norm").wait()
        norm = squared.sqrt()[0]
        coef = (max_norm / (norm + _CLIP_EPS)).clamp(max=1.0)
        for grad in grads:
            grad.detach().mul_(coef.to(grad.device, grad.dtype))
        return norm

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.zeros(1, dtype=torch.float32)
        if self.is_last_stage():
            loss = torch.stack([x.detach().float() for x in losses]).mean().reshape(1)
            self._dp_comm.all_reduce(loss, purpose="loss").wait()
            loss /= self._dp_comm.size
        self._pp_comm.broadcast(loss, src_rank=self.num_stages - 1, purpose="loss").wait()
        return loss[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine trains with train_batch() only (as DeepSpeed's)")

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pipeline engine trains with train_batch() only (as DeepSpeed's)")

    def step(self) -> None:
        raise RuntimeError("a pipeline engine trains with train_batch() only (as DeepSpeed's)")
