"""Building what ``initialize`` returns: the wrapped model, its optimizer and scheduler.

[Note: an optimizer built before wrapping]
DeepSpeed scripts build their optimizer over ``model.parameters()`` and then call
``initialize``. Wrapping replaces those parameters by this rank's shard views, so the
optimizer's parameter groups are re-pointed, name by name, at the shard views (group
options stay). That is only sound for an optimizer that has not stepped (no state yet),
and for one whose update is element-wise: a shard holds 1-D pieces of parameters, so an
optimizer that looks at a whole matrix (its norm, its shape) would compute something
else. DeepSpeed's ``zero_allow_untested_optimizer`` is the user's word that theirs is
element-wise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from ..assemble.root import is_root
from ..assemble.sharding import on_accelerator
from ..assemble.wrap_options import WrapOptions
from ..options import CommQuantization, CPUOffload, DiskOffload, MixedPrecision
from ..planner.estimate import STAGE_STRATEGIES
from ..wrap import ShardedModule
from .config import DeepSpeedConfig
from .zero import OffloadDevice, ZeroConfig

# Optimizers whose state DiskOffload places in files.
DISK_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)

# torch optimizers whose update treats every element on its own (safe on shards).
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def wrap_model(model: nn.Module, config: DeepSpeedConfig, auto_wrap_policy: Any) -> ShardedModule:
    """``model`` wrapped as the config says (or checked against it, when already wrapped)."""
    options = wrap_options_of(model, config, auto_wrap_policy)
    if is_root(model):  # a ShardedModule already (a unit module of one is not a root)
        sharded = cast(ShardedModule, model)
        _check_prewrapped(sharded, config, options)
    else:
        sharded = ShardedModule.from_options(model, options)
    apply_buckets(sharded, config.zero_optimization)
    return sharded


def wrap_options_of(
    model: nn.Module, config: DeepSpeedConfig, auto_wrap_policy: Any
) -> WrapOptions:
    """The config as ``WrapOptions``: the strategy of ``zero_optimization.stage``, offload,
    bf16/fp16, the persistence threshold and the ZeRO++ keys."""
    zero = config.zero_optimization
    cpu_offload: CPUOffload | DiskOffload | None = None
    if OffloadDevice.CPU in (zero.offload_param.device, zero.offload_optimizer.device):
        # One mechanism for both keys: the optimizer steps where the master shards live, so
        # stepping it on the CPU keeps them in host memory ([Note: host shards and staging]).
        cpu_offload = CPUOffload(offload_params=True)
    disk_offload = disk_offload_of(zero, on_accelerator(model))
    if disk_offload is not None:
        if cpu_offload is not None:
            raise ValueError(
                "zero_optimization: offload_param {device: cpu} together with "
                "offload_optimizer {device: nvme} is not supported"
            )
        cpu_offload = disk_offload
    return WrapOptions(
        sharding_strategy=STAGE_STRATEGIES[zero.stage],
        auto_wrap_policy=auto_wrap_policy,
        cpu_offload=cpu_offload,
        mixed_precision=mixed_precision_of(config),
        param_persistence_threshold=zero.unit_persistence_threshold,
        comm_quantization=comm_quantization_of(zero),
    )


def _check_prewrapped(model: ShardedModule, config: DeepSpeedConfig, wanted: WrapOptions) -> None:
    """A model wrapped before ``initialize`` must already be what the config asks for."""
    zero = config.zero_optimization
    if model.mixed_precision != wanted.mixed_precision:
        raise ValueError(
            f"model: a ShardedModule with mixed_precision={model.mixed_precision} does not "
            f"match the config's bf16/fp16 blocks ({wanted.mixed_precision})"
        )
    _check_prewrapped_offload(model, wanted.cpu_offload)
    if model.sharding_strategy is not wanted.sharding_strategy:
        raise ValueError(
            f"model: already a ShardedModule with {model.sharding_strategy.name}, but "
            f"zero_optimization.stage {zero.stage} means {wanted.sharding_strategy.name}"
        )
    threshold = wanted.param_persistence_threshold
    if threshold and threshold != model.param_persistence_threshold:
        raise ValueError(
            f"model: a ShardedModule with param_persistence_threshold="
            f"{model.param_persistence_threshold}, but the config's "
            f"zero_optimization.stage3_param_persistence_threshold is {threshold}"
        )
    _check_prewrapped_quantization(model, wanted.comm_quantization)


def apply_buckets(sharded: ShardedModule, zero: ZeroConfig) -> None:
    """The config's bucket sizes (elements) as ``sharded``'s byte budgets, where given.

    See [Note: bucket sizes] in ``zero.py``: reductions move ``reduce_dtype`` elements,
    all-gathers the compute dtype's; without mixed precision both are the parameters'.
    """
    precision = sharded.mixed_precision
    own = next((p.dtype for p in sharded.parameters() if p.is_floating_point()), torch.float32)
    compute = (precision.param_dtype if precision else None) or own
    reduce = (precision.reduce_dtype if precision else None) or compute
    if zero.reduce_bucket_size is not None:
        sharded.set_reduce_bucket_size(zero.reduce_bucket_size * reduce.itemsize)
    if zero.all_gather_bucket_size is not None:
        sharded.set_all_gather_bucket_size(zero.all_gather_bucket_size * compute.itemsize)


# DeepSpeed 0.19.8's widths: qwZ gathers int8 weights; qgZ's all-to-all reduction
# (runtime/comm/coalesced_collectives.py, all_to_all_quant_reduce) sends int4 gradients.
DEEPSPEED_WEIGHT_BITS, DEEPSPEED_GRADIENT_BITS = 8, 4


def comm_quantization_of(zero: ZeroConfig) -> CommQuantization | None:
    """The ZeRO++ keys as ``ShardedModule``'s ``comm_quantization`` (None: all off).

    Bit widths as DeepSpeed's: int8 weights, int4 gradients (a width is set only for a
    switch that is on, so a prewrapped model compares equal to what it asked for).
    """
    defaults = CommQuantization()
    gradients, weights = zero.zero_quantized_gradients, zero.zero_quantized_weights
    config = CommQuantization(
        weights=weights,
        weight_bits=DEEPSPEED_WEIGHT_BITS if weights else defaults.weight_bits,
        gradients=gradients,
        gradient_bits=DEEPSPEED_GRADIENT_BITS if gradients else defaults.gradient_bits,
        hpz_partition_size=zero.zero_hpz_partition_size,
    )
    return config if config.enabled else None


def _check_prewrapped_quantization(model: ShardedModule, wanted: CommQuantization | None) -> None:
    mine = model.comm_quantization if model.comm_quantization else None
    if mine is not None and not mine.enabled:
        mine = None
    if mine != wanted:
        raise ValueError(
            f"model: a ShardedModule with comm_quantization={mine}, but the config's ZeRO++ "
            f"keys (zero_quantized_weights, zero_quantized_gradients, zero_hpz_partition_size) "
            f"ask for {wanted}"
        )


def _check_prewrapped_offload(
    model: ShardedModule, cpu_offload: CPUOffload | DiskOffload | None
) -> None:
    """A wrapped model must already keep its shards where the config's offload asks."""
    if cpu_offload is None:
        return
    if isinstance(cpu_offload, DiskOffload):
        raise ValueError("model: give an unwrapped model when the config asks for offload")
    in_host_memory = all(p.device.type == "cpu" for p in model.parameters())
    if model.cpu_offload != cpu_offload and not in_host_memory:
        raise ValueError(
            "model: the config asks for offload to cpu, but this ShardedModule was built with "
            f"cpu_offload={model.cpu_offload!r} and keeps its shards on the device; give the "
            "unwrapped model, or wrap it with cpu_offload=CPUOffload(offload_params=True)"
        )


def disk_offload_of(zero: ZeroConfig, on_accelerator: bool) -> DiskOffload | None:
    """The ``DiskOffload`` that ``device: nvme`` asks for (``None`` if none does).

    ``offload_param`` and ``offload_optimizer`` map onto the same ``DiskOffload``: the
    parameter shards a rank keeps are its fp32 master shards (with bf16/fp16 the
    low-precision copy exists only while a unit is gathered), and the Adam state goes
    next to them, so either key, or both with one path, puts both on disk.
    ``sub_group_size`` bounds how much of them one optimizer step holds in memory.
    """
    blocks = {"offload_param": zero.offload_param, "offload_optimizer": zero.offload_optimizer}
    on_disk = {key: b.nvme_path for key, b in blocks.items() if b.device is OffloadDevice.NVME}
    if not on_disk:
        return None
    first = next(iter(on_disk))
    if on_accelerator:
        raise ValueError(
            f"zero_optimization.{first}: 'nvme' offload of an accelerator model is not "
            "supported yet (it keeps a CPU model's shards and Adam state on disk)"
        )
    if zero.offload_optimizer.device is OffloadDevice.CPU:
        raise ValueError(
            "zero_optimization: offload_param {device: nvme} with offload_optimizer "
            "{device: cpu} is not supported: the Adam state goes to disk with the master "
            "shards; use offload_optimizer {device: nvme} or leave it out"
        )
    if len(set(on_disk.values())) > 1:
        paths = ", ".join(f"{key}.nvme_path={path!r}" for key, path in on_disk.items())
        raise ValueError(
            f"zero_optimization: {paths} differ; shardwrap keeps parameter shards and "
            "optimizer state in one directory, so give both the same nvme_path"
        )
    return DiskOffload(on_disk[first], sub_group_size=zero.sub_group_size)  # type: ignore[arg-type]


def mixed_precision_of(config: DeepSpeedConfig) -> MixedPrecision | None:
    """bf16/fp16: compute and reduce in 16 bits; fp32 master shards and optimizer state.

    As DeepSpeed's, except that buffers keep their dtype (DeepSpeed casts the whole
    module) and floating inputs are always cast (DeepSpeed's ``auto_cast``).
    """
    if config.bf16.enabled:
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if config.fp16.enabled:
        return MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
    return None


def attach_optimizer(
    sharded: ShardedModule,
    config: DeepSpeedConfig,
    optimizer: torch.optim.Optimizer | Callable | None,
    model_parameters: Iterable | None,
    names: dict[int, str],
) -> torch.optim.Optimizer:
    """The optimizer over the shard views: from the config, a callable, or re-pointed."""
    if optimizer is not None and config.optimizer is not None:
        raise ValueError("optimizer: given both as an argument and in the config; keep one")
    shard_views = dict(sharded.named_parameters())
    groups = _parameter_groups(model_parameters, sharded, names, shard_views)
    if config.optimizer is not None:
        return config.optimizer.build(groups)
    if optimizer is None:
        raise ValueError("optimizer: none given; pass optimizer= or add an optimizer block")
    if isinstance(optimizer, torch.optim.Optimizer):
        _repoint(optimizer, names, shard_views)
        built = optimizer
    elif callable(optimizer):
        built = optimizer(groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"optimizer: the callable returned {type(built).__name__}")
    else:
        raise TypeError(f"optimizer: expected a torch optimizer or a callable, got {optimizer!r}")
    _check_elementwise(built, config)
    return built


def _remap(param: object, names: dict[int, str], shard_views: dict[str, nn.Parameter]):
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"model_parameters: expected parameters, got {type(param).__name__}")
    if any(param is view for view in shard_views.values()):
        return param  # already a shard view (e.g. model.parameters() read after wrapping)
    if id(param) in names:
        return shard_views[names[id(param)]]
    raise ValueError(f"optimizer: a parameter of shape {tuple(param.shape)} is not in the model")


def _parameter_groups(
    model_parameters: Iterable | None,
    sharded: ShardedModule,
    names: dict[int, str],
    shard_views: dict[str, nn.Parameter],
) -> list[dict]:
    if model_parameters is None:
        return [{"params": [p for p in sharded.parameters() if p.requires_grad]}]
    groups = []
    loose = []
    for entry in model_parameters:
        if isinstance(entry, dict):
            params = [_remap(p, names, shard_views) for p in entry["params"]]
            groups.append({**entry, "params": params})
        else:
            loose.append(_remap(entry, names, shard_views))
    if loose and groups:
        raise ValueError("model_parameters: mix of parameters and parameter-group dicts")
    return groups or [{"params": loose}]


def _repoint(
    optimizer: torch.optim.Optimizer, names: dict[int, str], shard_views: dict[str, nn.Parameter]
) -> None:
    if optimizer.state:
        raise ValueError(
            "optimizer: it has already stepped; build it before training, then pass it "
            "to initialize (its state cannot follow the parameters onto their shards)"
        )
    for group in optimizer.param_groups:
        group["params"] = [_remap(p, names, shard_views) for p in group["params"]]


def _check_elementwise(optimizer: torch.optim.Optimizer, config: DeepSpeedConfig) -> None:
    sharded_state = config.zero_optimization.stage >= 1
    if sharded_state and not config.zero_allow_untested_optimizer:
        if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            raise ValueError(
                f"optimizer: {type(optimizer).__name__} is not known to update element by "
                "element, which ZeRO stages 1-3 need (each rank holds 1-D pieces of the "
                "parameters); set zero_allow_untested_optimizer: true if it is"
            )


def build_scheduler(
    config: DeepSpeedConfig, optimizer: torch.optim.Optimizer, lr_scheduler: Any
) -> Any:
    """The scheduler from the config, a callable ``f(optimizer)``, or the one given."""
    if lr_scheduler is not None and config.scheduler is not None:
        raise ValueError("lr_scheduler: given both as an argument and in the config; keep one")
    if config.scheduler is not None:
        return config.scheduler.build(optimizer)
    if lr_scheduler is None or hasattr(lr_scheduler, "step"):
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    raise TypeError(f"lr_scheduler: expected a scheduler or a callable, got {lr_scheduler!r}")
