"""A typed, frozen reading of a DeepSpeed JSON config (the keys shardwrap accepts).

``DeepSpeedConfig.load(dict_or_path)`` validates every key: an unknown key is an error
that suggests the nearest known one; a DeepSpeed key whose feature shardwrap does not
implement is an error that says so (unless it is set to the value that leaves the
feature off). Defaults are DeepSpeed's. Sizes count elements, as in DeepSpeed.

Keys that shardwrap accepts and does not act on (DeepSpeed's own scheduling and staging
knobs) are validated and not kept; each warns once when it asks for something shardwrap
does not do ([Note: DeepSpeed keys not acted on] in ``unused.py``). Bucket sizes become
shardwrap's bucket budgets ([Note: bucket sizes] in ``zero.py``).

Likewise ``stage3_param_persistence_threshold``, *when the config gives it* at stage 3,
becomes ``ShardedModule``'s ``param_persistence_threshold``
(``ZeroConfig.unit_persistence_threshold``). DeepSpeed's threshold is per parameter and
ours per unit, so DeepSpeed's default (1e5) is not applied: on a small model it would
keep whole transformer blocks replicated, far more than DeepSpeed keeps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..base.validate import unique_keys
from . import keys as ds_keys
from .optimizer import OptimizerConfig, SchedulerConfig, parse_optimizer, parse_scheduler
from .sections import Section
from .unused import FP16_OFF, note_off_block, note_unused
from .zero import ZeroConfig, parse_zero

_ALWAYS = object()  # an "off value" no config can hold: the key is always rejected
MAX_INITIAL_SCALE_POWER = 63  # 2**63: far past any useful fp16 loss scale (fp16 max ~2**16)


@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config:
    """``fp16``; ``loss_scale`` 0 means dynamic loss scaling. The loss-scaling keys are
    kept only when the block is enabled (they warn otherwise); ``auto_cast`` is what
    shardwrap always does (floating inputs are cast)."""

    enabled: bool = False
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
class PipelineConfig:
    """``pipeline``: ``stages`` must equal the ``PipelineModule``'s ``num_stages`` when given
    (``None``: take the module's). See [Note: ZeRO inside pipeline stages]."""

    stages: int | None = None


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
    pipeline: PipelineConfig | None = None  # None: no "pipeline" block

    @classmethod
    def load(cls, config: Mapping | str | os.PathLike) -> DeepSpeedConfig:
        """Parse a dict or a JSON file path."""
        if isinstance(config, DeepSpeedConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            try:
                return parse_config(_read_json(config))
            except (TypeError, ValueError) as error:
                if str(error).startswith("config: "):
                    raise
                raise type(error)(f"config {os.fspath(config)!r}: {error}") from None
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
            data = json.load(handle, object_pairs_hook=unique_keys(f"config: {os.fspath(path)!r}"))
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
    "pipeline",
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
        zero_optimization=parse_zero(top.section("zero_optimization")),
        fp16=fp16,
        bf16=bf16,
        optimizer=parse_optimizer(top.get("optimizer")) if top.has("optimizer") else None,
        scheduler=parse_scheduler(top.get("scheduler")) if top.has("scheduler") else None,
        zero_allow_untested_optimizer=top.boolean("zero_allow_untested_optimizer", False),
        dataloader_drop_last=top.boolean("dataloader_drop_last", False),
        pipeline=_parse_pipeline(top.section("pipeline")) if top.has("pipeline") else None,
    )


# DeepSpeed's pipeline keys shardwrap does not implement: (off value, why).
_PIPELINE_REFUSALS = {
    "partition": ("best", "pass partition_method to the PipelineModule"),
    "seed_layers": (False, "seed torch yourself before building the PipelineModule"),
    "activation_checkpoint_interval": (0, "activation checkpointing inside stages is not done"),
}


def _parse_pipeline(raw: dict) -> PipelineConfig:
    # pipe_/grad_partitioned split activations over tensor-parallel ranks: nothing to do here.
    known = {"stages", "pipe_partitioned", "grad_partitioned"}
    section = Section("pipeline", raw, known=known, unsupported=_PIPELINE_REFUSALS)
    for key in ("pipe_partitioned", "grad_partitioned"):
        note_unused(section, key, section.boolean(key, True))
    return PipelineConfig(stages=section.integer("stages", None, minimum=1))


def _parse_fp16(raw: dict) -> FP16Config:
    names = set(FP16Config.__dataclass_fields__) | {"auto_cast"}
    section = Section("fp16", raw, known=names, unsupported=ds_keys.refusals(ds_keys.FP16_KEYS))
    enabled = section.boolean("enabled", False)
    note_unused(section, "auto_cast", section.boolean("auto_cast", False))
    parsed = FP16Config(
        enabled=enabled,
        loss_scale=section.number("loss_scale", 0.0, minimum=0.0),
        initial_scale_power=section.integer(
            "initial_scale_power", 16, minimum=0, maximum=MAX_INITIAL_SCALE_POWER
        ),
        loss_scale_window=section.integer("loss_scale_window", 1000, minimum=1),
        hysteresis=section.integer("hysteresis", 2, minimum=1),
        consecutive_hysteresis=section.boolean("consecutive_hysteresis", False),
        min_loss_scale=section.number("min_loss_scale", 1.0, minimum=0.0),
    )
    if enabled:
        return parsed
    defaults = FP16Config()
    scaling = sorted(names - {"enabled", "auto_cast"})
    note_off_block(section, {key: getattr(defaults, key) for key in scaling}, FP16_OFF)
    return defaults


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
