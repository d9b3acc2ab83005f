"""Every key DeepSpeed 0.19.8's config accepts, so none of them is ever called "unknown".

[Note: DeepSpeed's keys]
A DeepSpeed config carries keys of three kinds for shardwrap:
- keys shardwrap reads (``ds_config.py``);
- keys that only steer DeepSpeed's logging, timing and profiling (``LOGGING_KEYS``):
  accepted, with one warning naming those that ask for something, since nothing here
  logs for them;
- every other key DeepSpeed 0.19.8 reads: refused, with a message saying that it is a
  valid DeepSpeed key shardwrap does not support and what to use instead, unless it holds
  the value that leaves its feature off (DeepSpeed's default).
Only a key in none of these is "unknown" (with a did-you-mean suggestion).

The names and defaults were read off DeepSpeed 0.19.8's installed config code: the keys
``deepspeed.runtime.config.DeepSpeedConfig`` looks up in the top-level dict, and the fields
(and aliases) of its pydantic models for ``fp16``, ``bf16``, ``zero_optimization`` and the
two offload blocks.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

DEEPSPEED_VERSION = "0.19.8"

# Top-level keys that only steer logging, timing or profiling: no effect on training.
LOGGING_KEYS = (
    "steps_per_print",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "log_level",
    "timers",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "flops_profiler",
)

# Every top-level key DeepSpeed 0.19.8's DeepSpeedConfig reads.
TOP_LEVEL_KEYS = frozenset(
    {
        "activation_checkpointing",
        "aio",
        "amp",
        "autotuning",
        "bf16",
        "bfloat16",
        "checkpoint",
        "comet",
        "comms_logger",
        "communication_data_type",
        "compile",
        "compression_training",
        "csv_monitor",
        "curriculum_learning",
        "data_efficiency",
        "data_types",
        "dataloader_drop_last",
        "datastates_ckpt",
        "disable_allgather",
        "disable_python_gc",
        "dump_state",
        "eigenvalue",
        "elasticity",
        "expert_parallel",
        "flops_profiler",
        "fp16",
        "gradient_accumulation_steps",
        "gradient_allreduce_op",
        "gradient_clipping",
        "gradient_predivide_factor",
        "graph_harvesting",
        "hybrid_engine",
        "log_level",
        "managed_gradient_accumulation",
        "memory_breakdown",
        "nebula",
        "optimizer",
        "pipeline",
        "prescale_gradients",
        "progressive_layer_drop",
        "quantize_training",
        "scheduler",
        "seq_parallel_communication_data_type",
        "sparse_attention",
        "sparse_gradients",
        "steps_per_print",
        "tensor_parallel",
        "tensorboard",
        "timers",
        "torch_autocast",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "wall_clock_breakdown",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "zero_optimization",
    }
)

# Sub-keys of the blocks shardwrap reads that it does not implement: DeepSpeed's default
# (the value that leaves the feature off) and what to do instead.
FP16_KEYS = {
    "fp16_master_weights_and_grads": (
        False,
        "shardwrap keeps fp32 master weights and gradients, and DeepSpeed allows this only "
        "with its CPU Adam; leave it out, and save memory with "
        "offload_optimizer: {device: cpu} or bf16 instead",
    ),
}
BF16_KEYS = {
    "bf16_master_weights_and_grads": (False, "shardwrap keeps fp32 master weights and gradients"),
    "bf16_optimizer_states": (False, "shardwrap keeps fp32 optimizer state"),
    "immediate_grad_update": (False, "gradients are reduced per unit already"),
    "check_grad_overflow": (True, "bf16 steps are never skipped for inf/NaN here"),
}
ZERO_KEYS = {
    "use_multi_rank_bucket_allreduce": (True, "a communication tuning key"),
    "compute_grad_norm": (True, "the norm is computed when gradient_clipping asks for it"),
    "stage3_model_persistence_threshold": (sys.maxsize, "see stage3_param_persistence_threshold"),
    "stage3_module_granularity_threshold": (0, "units are chosen with auto_wrap_policy"),
    "stage3_use_all_reduce_for_fetch_params": (False, "parameters are all-gathered"),
    "stage3_allgather_sequential": (False, "a communication tuning key"),
    "stage3_gather_fp16_weights_on_model_save": (
        False,
        "deprecated by DeepSpeed; our checkpoints always hold every weight",
    ),
    "cpu_offload_param": (None, "deprecated by DeepSpeed; use offload_param: {device: cpu}"),
    "cpu_offload_use_pin_memory": (None, "deprecated by DeepSpeed; use offload_*.pin_memory"),
    "legacy_stage1": (False, "there is one ZeRO-1 implementation"),
    "parameter_alignment": (False, "shards are aligned by shardwrap"),
    "memory_efficient_linear": (True, "Linear layers are not replaced"),
    "pipeline_loading_checkpoint": (False, "pipeline parallelism is not supported"),
    "override_module_apply": (True, "use ShardedModule.summon_full_params around apply"),
    "log_trace_cache_warnings": (False, "there is no trace cache"),
    "enable_sanity_checks": (False, "there are no such checks"),
    "save_muon_momentum_buffer_in_memory": (False, "Muon is not supported"),
    "zenflow": (None, "ZenFlow is not supported"),
    "leaf_module": (None, "units are chosen with auto_wrap_policy"),
}
# DeepSpeed's pydantic field names for keys it also accepts as "stage3_<name>".
ZERO_ALIASES = {
    name: f"stage3_{name}"
    for name in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
    )
}
OFFLOAD_OPTIMIZER_KEYS = {
    "pipeline_read": (False, "nvme offload reads pages on demand"),
    "pipeline_write": (False, "nvme offload writes pages back through the page cache"),
    "super_offload": (False, "SuperOffload is not supported"),
    "cpuadam_cores_perc": (0.8, "the CPU step uses torch's optimizer and threads"),
}


def refusals(keys: Mapping[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]]:
    """``Section(unsupported=...)`` entries for valid DeepSpeed keys shardwrap lacks."""
    return {key: (off, valid_but_unsupported(why)) for key, (off, why) in keys.items()}


def valid_but_unsupported(why: str) -> str:
    return f"a valid DeepSpeed {DEEPSPEED_VERSION} key that shardwrap does not support: {why}"


def block_is_off(value: object) -> bool:
    """A top-level DeepSpeed block left off: absent-like, false, or ``{enabled: false}``."""
    if value is None or value is False or value == {}:
        return True
    return isinstance(value, Mapping) and value.get("enabled") is False and len(value) == 1


class OffWhen:
    """An "off value" that is a predicate (see ``Section``)."""

    def __init__(self, predicate: Callable[[object], bool]) -> None:
        self.predicate = predicate

    def __eq__(self, other: object) -> bool:
        return self.predicate(other)

    __hash__ = None  # type: ignore[assignment]


def other_top_level_refusals(handled: set[str]) -> dict[str, tuple[Any, str]]:
    """Refusals for the DeepSpeed top-level keys nobody else handles."""
    return {
        key: (
            OffWhen(block_is_off),
            valid_but_unsupported(f"the {key} feature is DeepSpeed-only; leave it out"),
        )
        for key in sorted(TOP_LEVEL_KEYS - handled - set(LOGGING_KEYS))
    }


def split_logging_keys(raw: Mapping) -> dict:
    """The config without its logging keys; one warning names those that ask for output."""
    asked = [key for key in LOGGING_KEYS if key in raw and not _logging_off(key, raw[key])]
    if asked:
        warnings.warn(
            f"config: ignoring {', '.join(asked)}: keys that steer DeepSpeed's logging or "
            "profiling, which shardwrap does not do (log from your training loop; profile "
            "with torch.profiler or shardwrap.profile)",
            UserWarning,
            stacklevel=_first_caller_outside_shardwrap(),
        )
    return {key: value for key, value in raw.items() if key not in LOGGING_KEYS}


def _first_caller_outside_shardwrap() -> int:
    """The ``stacklevel`` that points a warning at the user's line, not ours."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _logging_off(key: str, value: object) -> bool:
    if key == "log_level":
        return False
    if key == "steps_per_print":
        return value is None
    return block_is_off(value)


def rename_zero_aliases(raw: dict) -> dict:
    """``prefetch_bucket_size`` -> ``stage3_prefetch_bucket_size`` (DeepSpeed takes both)."""
    out = dict(raw)
    for short, long in ZERO_ALIASES.items():
        if short in out:
            if long in out:
                raise ValueError(
                    f"zero_optimization: {short} and {long} are the same key; give only one"
                )
            out[long] = out.pop(short)
    return out
