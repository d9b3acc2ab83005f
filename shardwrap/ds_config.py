"""A typed, frozen reading of a DeepSpeed JSON config (the keys shardwrap accepts).

``DeepSpeedConfig.load(dict_or_path)`` validates every key: an unknown key is an error
that suggests the nearest known one; a DeepSpeed key whose feature shardwrap does not
implement is an error that says so (unless it is set to the value that leaves the
feature off). Defaults are DeepSpeed's. Sizes count elements, as in DeepSpeed.

[Note: accepted tuning keys]
Some ``zero_optimization`` keys tune how DeepSpeed schedules its communication
(bucket sizes, overlap, prefetch depth, persistence threshold, live-parameter caps).
They never change results. shardwrap communicates one flat buffer per wrapped unit, so
its "bucket" is the unit; these keys are validated and kept on :class:`ZeroConfig` but
do not alter the schedule (docs/deepspeed.md lists each one).

One exception: ``stage3_param_persistence_threshold``, *when the config gives it* at
stage 3, becomes ``ShardedModule``'s ``param_persistence_threshold``
(``ZeroConfig.unit_persistence_threshold``). DeepSpeed's threshold is per parameter and
ours per unit, so DeepSpeed's default (1e5) is not applied: on a small model it would
keep whole transformer blocks replicated, far more than DeepSpeed keeps.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import ds_keys
from .config_keys import Section
from .ds_optimizer import OptimizerConfig, SchedulerConfig, parse_optimizer, parse_scheduler


class OffloadDevice(enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


_ALWAYS = object()  # an "off value" no config can hold: the key is always rejected


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3 only)."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (stages 1-3)."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    fast_init: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """``zero_optimization``: which ZeRO stage, offload, and DeepSpeed's tuning keys."""

    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool = False  # DeepSpeed turns it on by default for stage 3
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    sub_group_size: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True
    # Not a config key: stage3_param_persistence_threshold when the config sets it at
    # stage 3, else 0 (off); ShardedModule's param_persistence_threshold.
    unit_persistence_threshold: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config:
    """``fp16``; ``loss_scale`` 0 means dynamic loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0

    @property
    def initial_loss_scale(self) -> float:
        return 2.0**self.initial_scale_power if self.dynamic_loss_scale else self.loss_scale


@dataclass(frozen=True, kw_only=True, slots=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizes:
    """``train_batch_size = micro_batch_size * gradient_accumulation_steps * data_parallel``."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    data_parallel_size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedConfig:
    """The whole config. Batch sizes need the data-parallel size: see :meth:`batch_sizes`."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 1.0  # 0 = off; DeepSpeed's default clips at 1.0
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_allow_untested_optimizer: bool = False
    dataloader_drop_last: bool = False

    @classmethod
    def load(cls, config: Mapping | str | os.PathLike) -> DeepSpeedConfig:
        """Parse a dict or a JSON file path."""
        if isinstance(config, DeepSpeedConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            return cls.load(_read_json(config))
        return parse_config(config)

    def batch_sizes(self, data_parallel_size: int) -> BatchSizes:
        return derive_batch_sizes(
            train_batch_size=self.train_batch_size,
            micro_batch_size=self.train_micro_batch_size_per_gpu,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            data_parallel_size=data_parallel_size,
        )


def _read_json(path: str | os.PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"config: file {os.fspath(path)!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"config: {os.fspath(path)!r} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config: {os.fspath(path)!r} must hold a JSON object")
    return data


# Top-level DeepSpeed keys whose features shardwrap does not implement: (off value, why).
# Keys that only steer logging/profiling are accepted with a warning ([Note: DeepSpeed's keys]).
_UNSUPPORTED_TOP = {
    "prescale_gradients": (False, "gradients are averaged after reduction"),
    "gradient_predivide_factor": (1.0, "gradients are averaged after reduction"),
    "sparse_gradients": (False, "sparse gradients are not sharded"),
    "communication_data_type": (None, "collectives run in the parameter dtype"),
    "amp": (_ALWAYS, "use the bf16 or fp16 blocks"),
    "seed": (_ALWAYS, "seed torch yourself before building the model"),
}
for _feature in (
    "activation_checkpointing",
    "compression_training",
    "elasticity",
    "pipeline",
    "data_efficiency",
    "autotuning",
    "aio",
    "checkpoint",
    "sparse_attention",
    "zero_force_ds_cpu_optimizer",
):
    _UNSUPPORTED_TOP[_feature] = (_ALWAYS, f"the {_feature} feature is DeepSpeed-only")

_TOP_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "zero_allow_untested_optimizer",
    "dataloader_drop_last",
}


_UNSUPPORTED_TOP.update(ds_keys.other_top_level_refusals(_TOP_KEYS | set(_UNSUPPORTED_TOP)))


def parse_config(raw: Mapping) -> DeepSpeedConfig:
    """Validate a config mapping into a :class:`DeepSpeedConfig`."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"config: expected a mapping, got {type(raw).__name__}")
    raw = ds_keys.split_logging_keys(raw)
    top = Section("", raw, known=_TOP_KEYS, unsupported=_UNSUPPORTED_TOP)
    if top.has("bf16") and top.has("bfloat16"):
        raise ValueError("bf16 and bfloat16 are the same block; give only one of them")
    bf16_key = "bfloat16" if top.has("bfloat16") else "bf16"
    bf16_section = Section(
        bf16_key,
        top.section(bf16_key),
        known={"enabled"},
        unsupported=ds_keys.refusals(ds_keys.BF16_KEYS),
    )
    bf16 = BF16Config(enabled=bf16_section.boolean("enabled", False))
    fp16 = _parse_fp16(top.section("fp16"))
    if fp16.enabled and bf16.enabled:
        raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
    return DeepSpeedConfig(
        train_batch_size=top.integer("train_batch_size", None, minimum=1),
        train_micro_batch_size_per_gpu=top.integer(
            "train_micro_batch_size_per_gpu", None, minimum=1
        ),
        gradient_accumulation_steps=top.integer("gradient_accumulation_steps", None, minimum=1),
        gradient_clipping=top.number("gradient_clipping", 1.0, minimum=0.0),
        zero_optimization=_parse_zero(top.section("zero_optimization")),
        fp16=fp16,
        bf16=bf16,
        optimizer=parse_optimizer(top.get("optimizer")) if top.has("optimizer") else None,
        scheduler=parse_scheduler(top.get("scheduler")) if top.has("scheduler") else None,
        zero_allow_untested_optimizer=top.boolean("zero_allow_untested_optimizer", False),
        dataloader_drop_last=top.boolean("dataloader_drop_last", False),
    )


def _parse_fp16(raw: dict) -> FP16Config:
    names = {f for f in FP16Config.__dataclass_fields__}
    section = Section("fp16", raw, known=names, unsupported=ds_keys.refusals(ds_keys.FP16_KEYS))
    return FP16Config(
        enabled=section.boolean("enabled", False),
        auto_cast=section.boolean("auto_cast", False),
        loss_scale=section.number("loss_scale", 0.0, minimum=0.0),
        initial_scale_power=section.integer("initial_scale_power", 16),
        loss_scale_window=section.integer("loss_scale_window", 1000, minimum=1),
        hysteresis=section.integer("hysteresis", 2, minimum=1),
        consecutive_hysteresis=section.boolean("consecutive_hysteresis", False),
        min_loss_scale=section.number("min_loss_scale", 1.0, minimum=0.0),
    )


_ZERO_UNSUPPORTED = {
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning (hpZ)"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weights (qwZ)"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients (qgZ)"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized frozen weights"),
    "elastic_checkpoint": (False, "shardwrap checkpoints load on any number of ranks anyway"),
    "mics_shard_size": (-1, "MiCS sharding; use HYBRID_SHARD via ShardedModule"),
    "cpu_offload": (False, "deprecated DeepSpeed key; use offload_optimizer: {device: cpu}"),
    "load_from_fp32_weights": (True, "checkpoints always hold fp32 weights"),
}
_ZERO_BOOLS = (
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "stage3_gather_16bit_weights_on_model_save",
    "round_robin_gradients",
    "ignore_unused_parameters",
)
_ZERO_SIZES = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def _parse_zero(raw: dict) -> ZeroConfig:
    known = set(ZeroConfig.__dataclass_fields__) - {"unit_persistence_threshold"}
    unsupported = {**_ZERO_UNSUPPORTED, **ds_keys.refusals(ds_keys.ZERO_KEYS)}
    raw = ds_keys.rename_zero_aliases(raw)
    section = Section("zero_optimization", raw, known=known, unsupported=unsupported)
    stage = section.integer("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage}")
    defaults = ZeroConfig()
    values: dict = {"stage": stage}
    values["overlap_comm"] = section.boolean("overlap_comm", stage == 3)
    for name in _ZERO_BOOLS:
        values[name] = section.boolean(name, getattr(defaults, name))
    for name in _ZERO_SIZES:
        values[name] = section.integer(name, getattr(defaults, name))
    if stage == 3 and section.has("stage3_param_persistence_threshold"):
        values["unit_persistence_threshold"] = values["stage3_param_persistence_threshold"]
    # elements stepped between page releases under nvme offload (DiskOffload.sub_group_size)
    values["sub_group_size"] = section.integer("sub_group_size", defaults.sub_group_size, minimum=1)
    values["offload_param"] = _parse_offload_param(section.section("offload_param"))
    values["offload_optimizer"] = _parse_offload_optimizer(section.section("offload_optimizer"))
    if values["offload_param"].device is not OffloadDevice.NONE and stage != 3:
        raise ValueError(
            f"zero_optimization.offload_param: parameter offload needs stage 3, got stage {stage}"
        )
    if values["offload_optimizer"].device is not OffloadDevice.NONE and stage == 0:
        raise ValueError(
            "zero_optimization.offload_optimizer: optimizer offload needs stage 1, 2 or 3"
        )
    return ZeroConfig(**values)


def _offload_device(section: Section) -> tuple[OffloadDevice, str | None]:
    device = OffloadDevice(section.choice("device", "none", tuple(d.value for d in OffloadDevice)))
    path = section.get("nvme_path")
    if path is not None and not isinstance(path, str):
        raise TypeError(f"{section.child_path('nvme_path')}: expected a path string, got {path!r}")
    if device is OffloadDevice.NVME and not path:
        raise ValueError(f"{section.child_path('nvme_path')}: required when device is 'nvme'")
    return device, path


def _parse_offload_param(raw: dict) -> OffloadParamConfig:
    known = set(OffloadParamConfig.__dataclass_fields__)
    section = Section("zero_optimization.offload_param", raw, known=known)
    device, path = _offload_device(section)
    defaults = OffloadParamConfig()
    return OffloadParamConfig(
        device=device,
        nvme_path=path,
        pin_memory=section.boolean("pin_memory", False),
        buffer_count=section.integer("buffer_count", defaults.buffer_count, minimum=1),
        buffer_size=section.integer("buffer_size", defaults.buffer_size, minimum=1),
        max_in_cpu=section.integer("max_in_cpu", defaults.max_in_cpu),
    )


def _parse_offload_optimizer(raw: dict) -> OffloadOptimizerConfig:
    known = set(OffloadOptimizerConfig.__dataclass_fields__)
    unsupported = {
        "ratio": (1.0, "partial optimizer offload (ratio < 1)"),
        **ds_keys.refusals(ds_keys.OFFLOAD_OPTIMIZER_KEYS),
    }
    section = Section(
        "zero_optimization.offload_optimizer", raw, known=known, unsupported=unsupported
    )
    device, path = _offload_device(section)
    return OffloadOptimizerConfig(
        device=device,
        nvme_path=path,
        pin_memory=section.boolean("pin_memory", False),
        buffer_count=section.integer("buffer_count", 4, minimum=1),
        fast_init=section.boolean("fast_init", False),
    )


def derive_batch_sizes(
    *,
    train_batch_size: int | None,
    micro_batch_size: int | None,
    gradient_accumulation_steps: int | None,
    data_parallel_size: int,
) -> BatchSizes:
    """Fill in the missing batch size(s) as DeepSpeed does, and cross-check all three.

    With only ``train_batch_size`` or only the micro batch given, accumulation is 1.
    """
    train, micro, steps, world = (
        train_batch_size,
        micro_batch_size,
        gradient_accumulation_steps,
        data_parallel_size,
    )
    if train is None and micro is None:
        raise ValueError(
            "train_batch_size / train_micro_batch_size_per_gpu: give at least one of them"
        )
    if micro is None:
        steps = 1 if steps is None else steps
        micro = train // (steps * world) if train is not None else None
    elif train is None:
        steps = 1 if steps is None else steps
        train = micro * steps * world
    elif steps is None:
        steps = train // (micro * world)
    if not micro or not steps or train != micro * steps * world:
        raise ValueError(
            f"batch sizes do not fit: train_batch_size ({_shown(train_batch_size)}) must equal "
            f"train_micro_batch_size_per_gpu ({_shown(micro_batch_size)}) x "
            f"gradient_accumulation_steps ({_shown(gradient_accumulation_steps)}) x "
            f"data-parallel world size ({world})"
        )
    return BatchSizes(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=steps,
        data_parallel_size=world,
    )


def _shown(value: int | None) -> str:
    return "not given" if value is None else str(value)
