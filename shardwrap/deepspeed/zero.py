"""The ``zero_optimization`` block of a DeepSpeed config: stage, offload, tuning keys.

See ``config.py`` for how each key maps onto ``ShardedModule`` (or why it is ignored).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from . import keys as ds_keys
from .sections import Section


class OffloadDevice(enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


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
    # ZeRO++ (stage 3 only): ShardedModule's comm_quantization, see docs/zeropp.md
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1
    # Not a config key: stage3_param_persistence_threshold when the config sets it at
    # stage 3, else 0 (off); ShardedModule's param_persistence_threshold.
    unit_persistence_threshold: int = 0


_ZERO_UNSUPPORTED = {
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
    "zero_quantized_weights",
    "zero_quantized_gradients",
)
# ZeRO++'s keys, each with its off value and its name in the ZeRO++ paper.
ZERO_PLUS_PLUS = {
    "zero_quantized_weights": (False, "qwZ"),
    "zero_quantized_gradients": (False, "qgZ"),
    "zero_hpz_partition_size": (1, "hpZ"),
}
_ZERO_SIZES = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def parse_zero(raw: dict) -> ZeroConfig:
    """Read and validate the ``zero_optimization`` block."""
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
    values["zero_hpz_partition_size"] = section.integer("zero_hpz_partition_size", 1, minimum=1)
    for key, (off, name) in ZERO_PLUS_PLUS.items():
        if values[key] != off and stage != 3:
            raise ValueError(
                f"zero_optimization.{key}: ZeRO++ ({name}) needs stage 3, got stage {stage}"
            )
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
