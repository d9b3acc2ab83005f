"""``shardwrap.initialize``: DeepSpeed's front door onto the same ``ShardedModule`` machinery.

``zero_optimization.stage`` 0/1/2/3 selects NO_SHARD / SHARD_OPTIM / SHARD_GRAD_OP /
FULL_SHARD. ``engine.backward`` scales the loss by ``1 / gradient_accumulation_steps``
and skips gradient communication (``no_sync``) until the accumulation boundary;
``engine.step`` acts only at the boundary: clip, optimizer step, scheduler step, zero
the gradients. Checkpoints go through :mod:`shardwrap.checkpoint` (see
:mod:`shardwrap.deepspeed.engine_checkpoint`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..comm import collectives, launch
from ..comm.collectives import Communicator
from ..features.summon import units_of
from ..runtime.step import reduce_deferred_grads_for
from ..wrap import ShardedModule
from . import engine_checkpoint, top_level_api
from .config import DeepSpeedConfig
from .engine_parts import DISK_OPTIMIZERS, attach_optimizer, build_scheduler, wrap_model
from .loss_scaler import LossScaler


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    config: dict | str | os.PathLike | None = None,
    *,
    collate_fn: Callable | None = None,
    auto_wrap_policy: Any = None,
    distributed_port: int = launch.DEFAULT_PORT,
    dist_init_required: bool | None = None,
    config_params: dict | str | os.PathLike | None = None,
    mpu: Any = None,
    mesh_param: Any = None,
) -> tuple[ShardedEngine, torch.optim.Optimizer, DataLoader | None, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, dataloader, scheduler)``.

    ``config`` is a dict or a JSON path (or ``args.deepspeed_config``, or DeepSpeed's older
    ``config_params``). ``optimizer`` may be built before this call over
    ``model.parameters()``: its parameter groups are moved onto the shard views (it must
    not have stepped yet). ``auto_wrap_policy`` (ours) picks the units, as for
    ``ShardedModule``. Without a process group, one is set up from the launcher's
    environment as DeepSpeed does (:func:`shardwrap.comm.launch.init_distributed`); the
    data-parallel size is the world size. ``mpu`` and ``mesh_param`` (model parallelism)
    are refused.
    """
    config = top_level_api.config_from(args, config, config_params)
    if model is None or not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "initialize: mpu / mesh_param (model or sequence parallelism) are not supported; "
            "shardwrap is data parallel only"
        )
    launch.init_distributed(
        distributed_port=distributed_port, dist_init_required=dist_init_required
    )
    parsed = DeepSpeedConfig.load(config)
    if parsed.pipeline is not None:
        raise ValueError(
            "pipeline: give the model as a shardwrap.pipe.PipelineModule (layers, num_stages, "
            f"loss_fn), not a {type(model).__name__}"
        )
    batch = parsed.batch_sizes(collectives.world_size())
    # The originals stay referenced until the optimizer is attached: wrapping frees them, and
    # a shard view could then reuse a freed original's id and be taken for that parameter.
    originals = dict(model.named_parameters())
    names = {id(p): name for name, p in originals.items()}
    sharded = wrap_model(model, parsed, auto_wrap_policy)
    built_optimizer = attach_optimizer(sharded, parsed, optimizer, model_parameters, names)
    if sharded.disk_store is not None and type(built_optimizer) not in DISK_OPTIMIZERS:
        raise ValueError(
            "zero_optimization: 'nvme' keeps optimizer state on disk for "
            f"Adam and AdamW only, got {type(built_optimizer).__name__}"
        )
    del originals
    scheduler = build_scheduler(parsed, built_optimizer, lr_scheduler)
    engine = ShardedEngine(sharded, built_optimizer, scheduler, parsed, batch)
    loader = None
    if training_data is not None:
        loader = _dataloader(
            training_data, batch.train_micro_batch_size_per_gpu, parsed, collate_fn
        )
    return engine, built_optimizer, loader, scheduler


def _dataloader(
    data: Dataset, micro_batch: int, config: DeepSpeedConfig, collate_fn: Callable | None
) -> DataLoader:
    sampler = DistributedSampler(
        data, num_replicas=collectives.world_size(), rank=collectives.world_rank()
    )
    return DataLoader(
        data,
        batch_size=micro_batch,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
    )


class ShardedEngine(nn.Module):
    """What ``initialize`` returns: forward, ``backward``, ``step``, checkpoints.

    ``engine.module`` is the :class:`ShardedModule`; ``engine.module.module`` the model.
    """

    def __init__(
        self,
        module: ShardedModule,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        config: DeepSpeedConfig,
        batch: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.batch_sizes = batch
        self.micro_steps = 0  # backward/step pairs so far
        self.global_steps = 0  # optimizer steps so far (skipped fp16 overflow steps too)
        self.skipped_steps = 0  # fp16 steps skipped for an inf/NaN gradient
        self._step_applied = False  # whether the last boundary step updated the weights
        self._global_grad_norm: float | None = None  # from the last clipping, if any
        self.loss_scaler = LossScaler(config.fp16) if config.fp16.enabled else None
        self._world_comm = Communicator(collectives.default_group(), module.comm_ledger)

    # ---------------------------------------------------- DeepSpeed's accessors
    def train_batch_size(self) -> int:
        return self.batch_sizes.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch_sizes.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.batch_sizes.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def get_global_grad_norm(self) -> float | None:
        """The gradients' global 2-norm before clipping at the last applied step.

        ``None`` when ``gradient_clipping`` is off (the norm is computed only to clip) or
        before the first step.
        """
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary step was skipped (fp16 inf/NaN) or none ran yet."""
        return self._step_applied

    @property
    def global_rank(self) -> int:
        return collectives.world_rank()

    @property
    def world_size(self) -> int:
        return collectives.world_size()

    @property
    def local_rank(self) -> int:
        """The launcher's ``LOCAL_RANK`` (0 without one)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        """Where the model computes (the accelerator also under CPU offload)."""
        for unit in units_of(self.module, recurse=True):
            if unit.handle is not None:
                return unit.handle.compute_device
        return next(self.module.parameters(), torch.empty(0)).device

    # -------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps``; communicate at the boundary."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("backward: expected a scalar loss tensor")
        scaled = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scaled = scaled * torch.tensor(self.loss_scaler.scale, dtype=torch.float32)
        boundary = self.is_gradient_accumulation_boundary()
        with contextlib.nullcontext() if boundary else self.module.no_sync():
            scaled.backward()
        return loss

    def step(self) -> None:
        """At the accumulation boundary: clip, step, schedule, zero grads. Counts a micro-step."""
        if self.is_gradient_accumulation_boundary():
            self._optimizer_step()
            self.global_steps += 1
        self.micro_steps += 1

    def _optimizer_step(self) -> None:
        self._step_applied = False
        if self.loss_scaler is not None and not self._unscale_gradients():
            self.skipped_steps += 1
            self.loss_scaler.update(overflow=True)
            self.zero_grad()
            return
        if self.config.gradient_clipping > 0:
            # Also reduces ZeRO-1's deferred gradients first; the step then finds none.
            norm = self.module.clip_grad_norm_(self.config.gradient_clipping)
            self._global_grad_norm = float(norm)
        self.optimizer.step()
        self._step_applied = True
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        self.zero_grad()

    def _unscale_gradients(self) -> bool:
        """fp16: divide the gradients by the loss scale; False if any rank saw inf/NaN."""
        reduce_deferred_grads_for(self.optimizer)  # ZeRO-1 gradients left by no_sync, if any
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.loss_scaler.dynamic:  # type: ignore[union-attr]
            local = any(not bool(torch.isfinite(g).all()) for g in grads)
            flag = torch.tensor([float(local)])
            self._world_comm.all_reduce(flag, purpose="found_inf", op=dist.ReduceOp.MAX).wait()
            if flag.item() > 0:
                return False
        inverse = 1.0 / self.loss_scaler.scale  # type: ignore[union-attr]
        with torch.no_grad():
            for grad in grads:
                grad.mul_(inverse)
        return True

    def zero_grad(self) -> None:
        """Drop every gradient of the model (also those of parameters the optimizer lacks)."""
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.module.parameters():
            param.grad = None

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        asynchronous: bool = False,
    ) -> Any:
        """Save under ``save_dir/tag`` (default tag ``global_step<N>``); returns True.

        (DeepSpeed's return value; the checkpoint is the directory ``save_dir/tag``.) With
        ``asynchronous`` it returns the save's handle instead (``result()`` raises its
        failure; ``latest`` names the tag once committed): see ``save_checkpoint``.
        """
        if exclude_frozen_parameters:
            raise ValueError(
                "save_checkpoint: exclude_frozen_parameters=True is not supported; "
                "checkpoints hold every parameter"
            )
        _, handle = engine_checkpoint.save(
            self, save_dir, tag, client_state or {}, save_latest, asynchronous
        )
        return True if handle is None else handle

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable | None = None,
    ) -> tuple[str | None, dict | None]:
        """Load ``load_dir/tag`` (default: the tag in ``load_dir/latest``).

        Returns ``(path, client_state)``, or ``(None, None)`` when no tag is given and
        ``load_dir`` has no ``latest`` file (DeepSpeed's contract: start fresh).
        ``client_state`` is the dict given to ``save_checkpoint`` (DeepSpeed's also holds
        its own bookkeeping keys). ``custom_load_fn`` is refused.
        """
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported")
        return engine_checkpoint.load(
            self,
            load_dir,
            tag,
            strict=load_module_strict,
            load_optimizer=load_optimizer_states and not load_module_only,
            load_scheduler=load_lr_scheduler_states and not load_module_only,
            load_counters=not load_module_only,
        )
