"""DeepSpeed keys shardwrap accepts but does not act on, and what it does instead.

[Note: DeepSpeed keys not acted on]
Some keys tune how DeepSpeed schedules its own communication and staging (overlap,
live-parameter caps, nvme buffer counts, activation partitioning between pipeline stages).
They never change results, and shardwrap's engine has its own schedule, so it accepts them
(a DeepSpeed config must keep working) and does not act on them. The rule, for every such
key ([Note: accepted but not acted on] in ``base/warn_once.py``):

* absent from the config: nothing is said (a user who did not set it sees nothing);
* given at the value that asks for what shardwrap always does (``matches``, e.g.
  ``overlap_comm: true``): nothing is said, since it is acted on;
* given at any other value: one ``UserWarning`` per process naming the key, the value and
  what shardwrap does instead, *even when the value is DeepSpeed's default*. A default
  written out is still asked for: ``overlap_comm: false`` at stage 1 or 2 (DeepSpeed's
  default there) asks for no overlap and ``fp16.auto_cast: false`` for inputs left
  uncast, while shardwrap always overlaps and casts. Whether a key is given is
  ``Section.has``: the raw mapping, before any default is read.

The loss-scaling keys of an ``fp16`` block that is off (``note_off_block``) follow another
rule: DeepSpeed ignores them too, so only a value other than the default (one the user
chose) warns.

Keys with a natural counterpart are acted on instead and are not listed here: the bucket
sizes become ``set_reduce_bucket_size`` / ``set_all_gather_bucket_size`` (``zero.py``).
docs/deepspeed.md has this table for users.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base.warn_once import warn_once
from .sections import Section

_NONE = object()  # "no value matches": any value given warns


@dataclass(frozen=True, slots=True)
class Unused:
    """What shardwrap does instead of a key, and the value that asks for exactly that."""

    instead: str
    matches: object = _NONE


_ALWAYS_GATHERED = "a unit's parameters are gathered only while it runs, plus one unit "
UNUSED = {
    "zero_optimization.contiguous_gradients": Unused(
        "gradients are always reduced into one contiguous flat buffer per unit", True
    ),
    "zero_optimization.overlap_comm": Unused(
        "communication always overlaps computation (all-gathers are prefetched, reductions "
        "are waited for late); see docs/deepspeed.md",
        True,
    ),
    "zero_optimization.reduce_scatter": Unused(
        "sharded gradients are always reduce-scattered (all-reduced where a unit is replicated)",
        True,
    ),
    "zero_optimization.allgather_partitions": Unused("parameters are always all-gathered", True),
    "zero_optimization.round_robin_gradients": Unused(
        "gradients move to host memory one unit at a time; there is nothing to round-robin",
        False,
    ),
    "zero_optimization.ignore_unused_parameters": Unused(
        "parameters that get no gradient are always handled (their gradient is zero), never "
        "an error",
        True,
    ),
    "zero_optimization.stage3_max_live_parameters": Unused(
        _ALWAYS_GATHERED + "prefetched or one all-gather bucket (stage3_prefetch_bucket_size); "
        "there is no cap to set"
    ),
    "zero_optimization.stage3_max_reuse_distance": Unused(
        "units are freed after forward and after backward by the strategy's rule "
        "(ShardedModule.set_reshard_after_forward keeps one gathered), not by reuse distance"
    ),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Unused(
        "there is no save_16bit_model; save_checkpoint stores every weight in fp32, and "
        "state_dict() / python -m shardwrap consolidate give them whole",
        False,
    ),
    "zero_optimization.allgather_bucket_size": Unused(
        "used at stages 1 and 2 only, as in DeepSpeed (stage 3 buckets its all-gathers by "
        "stage3_prefetch_bucket_size)"
    ),
    "zero_optimization.stage3_prefetch_bucket_size": Unused("used at stage 3 only"),
    "zero_optimization.stage3_param_persistence_threshold": Unused("used at stage 3 only"),
    "zero_optimization.sub_group_size": Unused(
        "used with offload to nvme only; otherwise each rank's optimizer steps its whole shard"
    ),
    "zero_optimization.offload_param.nvme_path": Unused("used with device: nvme only", None),
    "zero_optimization.offload_optimizer.nvme_path": Unused("used with device: nvme only", None),
    "zero_optimization.offload_param.pin_memory": Unused(
        "host shards are page-locked whenever CUDA is available", True
    ),
    "zero_optimization.offload_optimizer.pin_memory": Unused(
        "host shards are page-locked whenever CUDA is available", True
    ),
    "zero_optimization.offload_param.buffer_count": Unused(
        "nvme offload maps its files; the page cache stages what is in use"
    ),
    "zero_optimization.offload_param.buffer_size": Unused(
        "nvme offload maps its files; the page cache stages what is in use"
    ),
    "zero_optimization.offload_param.max_in_cpu": Unused(
        "nvme offload maps its files; the page cache decides what stays in memory"
    ),
    "zero_optimization.offload_optimizer.buffer_count": Unused(
        "nvme offload maps its files; the page cache stages what is in use"
    ),
    "zero_optimization.offload_optimizer.fast_init": Unused(
        "the optimizer state files are created empty and filled by the first step"
    ),
    "pipeline.pipe_partitioned": Unused(
        "activations are sent whole between stages (there is no tensor parallelism inside "
        "a stage to split them over)",
        False,
    ),
    "pipeline.grad_partitioned": Unused(
        "gradients are sent whole between stages (there is no tensor parallelism inside "
        "a stage to split them over)",
        False,
    ),
    "fp16.auto_cast": Unused("floating inputs are always cast to fp16", True),
    "optimizer.params.torch_adam": Unused("torch's Adam/AdamW is always used", True),
}
# fp16's loss-scaling keys, when the block is not enabled (DeepSpeed ignores them too).
FP16_OFF = "fp16 is not enabled, so there is no loss scaling to tune"


def note_unused(section: Section, key: str, value: object) -> None:
    """Warn once if ``section`` gives ``key`` and its ``value`` asks for something not done.

    A key the config does not give says nothing; a given one warns unless it ``matches``,
    whether or not ``value`` is DeepSpeed's default. See [Note: DeepSpeed keys not acted on].
    """
    name = section.child_path(key)
    unused = UNUSED[name]
    if not section.has(key) or value == unused.matches:
        return
    warn_once(f"config {name}", f"{value!r} is not acted on by shardwrap: {unused.instead}")


def note_off_block(section: Section, defaults: dict[str, object], why: str) -> None:
    """Warn once for each key of a block that is off, given a value other than its default."""
    for key, default in defaults.items():
        if section.has(key) and section.get(key) != default:
            value = section.get(key)
            warn_once(
                f"config {section.child_path(key)}",
                f"{value!r} is not acted on by shardwrap: {why}",
            )
