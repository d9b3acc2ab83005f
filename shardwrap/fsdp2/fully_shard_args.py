"""``fully_shard``'s arguments, parsed into what the engine acts on; everything else refused.

torch's own option records (``MixedPrecisionPolicy``, ``OffloadPolicy``) are the defaults,
so ``fully_shard``'s signature is torch's. This slice supports fp32 training with the
default policies: a policy that asks for anything else is refused with its name and what
to do, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from ..base.validate import check_bool

NOT_YET = "is not yet supported by shardwrap.fully_shard"


@dataclass(frozen=True, slots=True)
class UnitOptions:
    """What one ``fully_shard`` call asks of its unit."""

    # True/False as given; None: FSDP2's default, decided once the root is known
    # (False for the root, which backward needs first, True for every other unit).
    reshard_after_forward: bool | None


def parse_options(
    *,
    reshard_after_forward: object,
    shard_placement_fn: object,
    mp_policy: object,
    offload_policy: object,
    ignored_params: object,
    dp_mesh_dims: object,
) -> UnitOptions:
    """Check ``fully_shard``'s keyword arguments (errors name the argument)."""
    if reshard_after_forward is not None:
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward}: resharding to a smaller "
                f"world (an int) {NOT_YET}; pass True, False or None"
            )
        check_bool("reshard_after_forward", reshard_after_forward)
    if shard_placement_fn is not None:
        raise ValueError(
            f"shard_placement_fn {NOT_YET}: parameters are sharded on dim 0 (Shard(0)); pass None"
        )
    _check_mp_policy(mp_policy)
    _check_offload_policy(offload_policy)
    if ignored_params:
        raise ValueError(
            f"ignored_params {NOT_YET}; move those parameters to a module outside the "
            "fully_shard call, or pass None"
        )
    if dp_mesh_dims is not None:
        raise ValueError(f"dp_mesh_dims {NOT_YET}; pass a 1-D mesh as mesh=")
    return UnitOptions(reshard_after_forward=reshard_after_forward)  # type: ignore[arg-type]


def _check_mp_policy(mp_policy: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy: expected a MixedPrecisionPolicy, got {type(mp_policy).__name__}"
        )
    if mp_policy != MixedPrecisionPolicy():
        raise ValueError(
            f"mp_policy={mp_policy}: mixed precision {NOT_YET} (fp32 only in this release); "
            "pass MixedPrecisionPolicy(), or use shardwrap.ShardedModule(mixed_precision=...)"
        )


def _check_offload_policy(offload_policy: object) -> None:
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy: expected an OffloadPolicy, got {type(offload_policy).__name__}"
        )
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise ValueError(
            f"offload_policy=CPUOffloadPolicy() {NOT_YET}; pass OffloadPolicy(), or use "
            "shardwrap.ShardedModule(cpu_offload=CPUOffload())"
        )
