"""The ``zero_optimization`` block of a DeepSpeed config: stage, offload, buckets, ZeRO++.

``engine_parts.py`` maps the result onto ``ShardedModule``; the keys not acted on are listed, with
what shardwrap does instead, in ``unused.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from . import keys as ds_keys
from .sections import Section
from .unused import note_unused


class OffloadDevice(enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3 only); ``nvme_path`` only with nvme."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (stages 1-3); ``nvme_path`` only with nvme."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """``zero_optimization``, as what shardwrap does with it.

    Only keys that are acted on are kept; the others warn when they ask for something
    ([Note: DeepSpeed keys not acted on] in ``unused.py``). Sizes count elements.
    """

    stage: int = 0
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    # Elements stepped between page releases under nvme offload (DiskOffload.sub_group_size);
    # DeepSpeed's default when no nvme offload uses it.
    sub_group_size: int = 1_000_000_000
    # ZeRO++ (stage 3 only): ShardedModule's comm_quantization, see docs/zeropp.md
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1
    # Not config keys; see [Note: bucket sizes]. None: the config does not give them.
    reduce_bucket_size: int | None = None  # -> ShardedModule.set_reduce_bucket_size
    all_gather_bucket_size: int | None = None  # -> ShardedModule.set_all_gather_bucket_size
    # Not a config key: stage3_param_persistence_threshold when the config sets it at
    # stage 3, else 0 (off); ShardedModule's param_persistence_threshold.
    unit_persistence_threshold: int = 0


# [Note: bucket sizes]
# DeepSpeed's bucket keys count elements; shardwrap's buckets count bytes (engine_parts.py converts
# with the reduction's and the gathered parameters' element sizes). They are applied only
# when the config gives them, as stage3_param_persistence_threshold is, so a config without
# them keeps shardwrap's own defaults: DeepSpeed's 5e8 elements would make the whole model
# one bucket. reduce_bucket_size applies at every stage; the all-gather bucket comes from
# allgather_bucket_size at stages 1 and 2 and from stage3_prefetch_bucket_size at stage 3,
# where DeepSpeed reads each of them.

_ZERO_UNSUPPORTED = {
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized frozen weights"),
    "elastic_checkpoint": (False, "shardwrap checkpoints load on any number of ranks anyway"),
    "mics_shard_size": (-1, "MiCS sharding; use HYBRID_SHARD via ShardedModule"),
    "cpu_offload": (False, "deprecated DeepSpeed key; use offload_optimizer: {device: cpu}"),
    "load_from_fp32_weights": (True, "checkpoints always hold fp32 weights"),
}
# Keys read into ZeroConfig (the rest of the accepted keys are in unused.UNUSED).
_ZERO_READ = {
    "stage",
    "offload_param",
    "offload_optimizer",
    "sub_group_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_hpz_partition_size",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
}
# Accepted, validated, and not acted on: (DeepSpeed's default; None: see overlap_comm).
_ZERO_UNUSED_BOOLS = {
    "contiguous_gradients": True,
    "overlap_comm": None,  # DeepSpeed's default: true at stage 3 only
    "reduce_scatter": True,
    "allgather_partitions": True,
    "round_robin_gradients": False,
    "ignore_unused_parameters": True,
    "stage3_gather_16bit_weights_on_model_save": False,
}
_ZERO_UNUSED_SIZES = {
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default sub_group_size
# DeepSpeed's defaults of the keys read only at some stages.
_REDUCE_BUCKET, _ALLGATHER_BUCKET, _PREFETCH_BUCKET, _PERSISTENCE = (
    500_000_000,
    500_000_000,
    50_000_000,
    100_000,
)
# ZeRO++'s keys, each with its off value and its name in the ZeRO++ paper.
ZERO_PLUS_PLUS = {
    "zero_quantized_weights": (False, "qwZ"),
    "zero_quantized_gradients": (False, "qgZ"),
    "zero_hpz_partition_size": (1, "hpZ"),
}


def parse_zero(raw: dict) -> ZeroConfig:
    """Read and validate the ``zero_optimization`` block."""
    known = _ZERO_READ | set(_ZERO_UNUSED_BOOLS) | set(_ZERO_UNUSED_SIZES)
    unsupported = {**_ZERO_UNSUPPORTED, **ds_keys.refusals(ds_keys.ZERO_KEYS)}
    raw = ds_keys.rename_zero_aliases(raw)
    section = Section("zero_optimization", raw, known=known, unsupported=unsupported)
    stage = section.integer("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage}")
    _note_unused_keys(section, stage)
    values: dict = {"stage": stage}
    for name in ("zero_quantized_weights", "zero_quantized_gradients"):
        values[name] = section.boolean(name, False)
    values["zero_hpz_partition_size"] = section.integer("zero_hpz_partition_size", 1, minimum=1)
    for key, (off, name) in ZERO_PLUS_PLUS.items():
        if values[key] != off and stage != 3:
            raise ValueError(
                f"zero_optimization.{key}: ZeRO++ ({name}) needs stage 3, got stage {stage}"
            )
    values.update(_buckets(section, stage))
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
    sub_group = section.integer("sub_group_size", SUB_GROUP_SIZE, minimum=1)
    on_disk = OffloadDevice.NVME in (
        values["offload_param"].device,
        values["offload_optimizer"].device,
    )
    if on_disk:
        values["sub_group_size"] = sub_group
    else:
        note_unused(section, "sub_group_size", sub_group)
    return ZeroConfig(**values)


def _note_unused_keys(section: Section, stage: int) -> None:
    """Validate the keys shardwrap does not act on; warn for those that ask for something."""
    for key, default in _ZERO_UNUSED_BOOLS.items():
        default = stage == 3 if default is None else default
        note_unused(section, key, section.boolean(key, default))
    for key, default in _ZERO_UNUSED_SIZES.items():
        note_unused(section, key, section.integer(key, default))


def _buckets(section: Section, stage: int) -> dict:
    """The bucket sizes and persistence threshold this stage acts on ([Note: bucket sizes])."""
    values: dict = {}
    reduce = section.integer("reduce_bucket_size", _REDUCE_BUCKET)
    allgather = section.integer("allgather_bucket_size", _ALLGATHER_BUCKET)
    prefetch = section.integer("stage3_prefetch_bucket_size", _PREFETCH_BUCKET)
    persistence = section.integer("stage3_param_persistence_threshold", _PERSISTENCE)
    if section.has("reduce_bucket_size"):
        values["reduce_bucket_size"] = reduce
    if stage in (1, 2) and section.has("allgather_bucket_size"):
        values["all_gather_bucket_size"] = allgather
    elif stage not in (1, 2):
        note_unused(section, "allgather_bucket_size", allgather)
    if stage == 3:
        if section.has("stage3_prefetch_bucket_size"):
            values["all_gather_bucket_size"] = prefetch
        if section.has("stage3_param_persistence_threshold"):
            values["unit_persistence_threshold"] = persistence
    else:
        note_unused(section, "stage3_prefetch_bucket_size", prefetch)
        note_unused(section, "stage3_param_persistence_threshold", persistence)
    return values


def _offload_device(section: Section) -> tuple[OffloadDevice, str | None]:
    device = OffloadDevice(section.choice("device", "none", tuple(d.value for d in OffloadDevice)))
    path = section.get("nvme_path")
    if path is not None and not isinstance(path, str):
        raise TypeError(f"{section.child_path('nvme_path')}: expected a path string, got {path!r}")
    if device is OffloadDevice.NVME and not path:
        raise ValueError(f"{section.child_path('nvme_path')}: required when device is 'nvme'")
    if device is not OffloadDevice.NVME:
        note_unused(section, "nvme_path", path)
        path = None
    return device, path


def _parse_offload_param(raw: dict) -> OffloadParamConfig:
    unused = {"pin_memory": False, "buffer_count": 5, "buffer_size": 100_000_000}
    unused["max_in_cpu"] = 1_000_000_000
    section = Section(
        "zero_optimization.offload_param", raw, known={"device", "nvme_path", *unused}
    )
    device, path = _offload_device(section)
    note_unused(section, "pin_memory", section.boolean("pin_memory", False))
    for key, default in unused.items():
        if key != "pin_memory":
            note_unused(section, key, section.integer(key, default, minimum=1))
    return OffloadParamConfig(device=device, nvme_path=path)


def _parse_offload_optimizer(raw: dict) -> OffloadOptimizerConfig:
    known = {"device", "nvme_path", "pin_memory", "buffer_count", "fast_init"}
    unsupported = {
        "ratio": (1.0, "partial optimizer offload (ratio < 1)"),
        **ds_keys.refusals(ds_keys.OFFLOAD_OPTIMIZER_KEYS),
    }
    section = Section(
        "zero_optimization.offload_optimizer", raw, known=known, unsupported=unsupported
    )
    device, path = _offload_device(section)
    note_unused(section, "pin_memory", section.boolean("pin_memory", False))
    note_unused(section, "buffer_count", section.integer("buffer_count", 4, minimum=1))
    note_unused(section, "fast_init", section.boolean("fast_init", False))
    return OffloadOptimizerConfig(device=device, nvme_path=path)
