"""qwZ under activation checkpointing: the recompute sees the weights forward saw.

[Note: every gather under qwZ is quantized] in shardwrap/core/comm_quant.py. The
reference is the same model without checkpointing, trained side by side in the same
process on the same batches: checkpointing changes no number there (the recompute runs
the same ops on the same inputs), so with qwZ every gradient and loss must be equal bit
for bit, step after step. The negative control puts the old behaviour back (only gathers
for forward quantized, so a recompute in backward got full-precision weights) and shows
that the comparison catches it.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import shardwrap
from benchmarks import gpt
from shardwrap import CommQuantization
from shardwrap.core.comm_quant import GatherPhase, UnitCommQuant
from shardwrap.policies import ModuleWrapPolicy
from tests.dist.harness import run_ranks

CONFIG = gpt.GPTConfig(vocab=128, dim=64, depth=2, num_heads=4, seq=32)
BATCH = 2
NUM_STEPS = 2  # the second step keeps the last unit gathered from forward into backward
MODES = ("non_reentrant", "reentrant", "inside_unit")


class CheckpointedBlock(gpt.Block):
    """A block whose body runs under a non-reentrant checkpoint, inside the unit's hooks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


def _wrap(strategy: str, quant: dict, mode: str | None) -> shardwrap.ShardedModule:
    torch.manual_seed(1234)
    module = gpt.build(CONFIG)
    if mode == "inside_unit":
        for block in module.blocks:
            block.__class__ = CheckpointedBlock
    model = shardwrap.ShardedModule(
        module,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
        comm_quantization=CommQuantization(**quant),
    )
    if mode in ("non_reentrant", "reentrant"):  # around each unit, as FSDP users apply it
        impl = CheckpointImpl.REENTRANT if mode == "reentrant" else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, gpt.Block),
        )
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by parameter name, the checkpoint wrappers' prefix taken out."""
    return {
        name.replace(f".{_CHECKPOINT_WRAPPED_MODULE}", ""): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _mismatches(rank: int, strategy: str, quant: dict, mode: str) -> list[str]:
    """Names (and steps) where the checkpointed model differs from the plain one."""
    plain, checkpointed = _wrap(strategy, quant, None), _wrap(strategy, quant, mode)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, checkpointed)]
    found = []
    for step in range(NUM_STEPS):
        inputs, targets = gpt.batch(CONFIG, step=step, rank=rank, batch_size=BATCH)
        grads, losses = [], []
        for model, optim in zip((plain, checkpointed), optims, strict=True):
            loss = gpt.loss_fn(model(inputs), targets)
            loss.backward()
            losses.append(loss.detach())
            grads.append(_grads(model))
            optim.step()
            optim.zero_grad()
        assert grads[0].keys() == grads[1].keys() and grads[0], (step, grads[0].keys())
        found += [f"{step}: loss"] * (not torch.equal(*losses))
        found += [f"{step}: {n}" for n, g in grads[0].items() if not torch.equal(g, grads[1][n])]
    return found


CASES = [("FULL_SHARD", "weights", mode) for mode in MODES] + [
    ("SHARD_GRAD_OP", "weights", "reentrant")  # the only SHARD_GRAD_OP recompute that gathers
]
QUANTS = {"weights": {"weights": True}, "all_three": {"weights": True, "hpz_partition_size": 2}}


def _forward_only_codec(self: UnitCommQuant):
    """The old rule: quantize only the gathers for forward."""
    return self.weight_codec if self.phase is GatherPhase.FORWARD else None


def _worker(rank: int, world_size: int, cases: list, old_behaviour: bool) -> dict:
    rule = UnitCommQuant.gather_codec
    if old_behaviour:  # the bug put back, on this pooled rank for this task only
        UnitCommQuant.gather_codec = _forward_only_codec
    try:
        return {case: _mismatches(rank, case[0], QUANTS[case[1]], case[2]) for case in cases}
    finally:
        UnitCommQuant.gather_codec = rule


def test_checkpointed_gradients_equal_plain_ones_bit_for_bit() -> None:
    for result in run_ranks(_worker, 2, CASES, False):
        assert result == {case: [] for case in CASES}, result


def test_hpz_with_qwz_checkpointed_gradients_equal_plain_ones() -> None:
    # hpZ groups of 2 inside 4 ranks: backward gathers the secondary shard, sliced from
    # the quantized values forward (or the reentrant recompute) gathered.
    cases = [("FULL_SHARD", "all_three", mode) for mode in ("non_reentrant", "reentrant")]
    for result in run_ranks(_worker, 4, cases, False):
        assert result == {case: [] for case in cases}, result


def test_the_comparison_catches_a_full_precision_recompute() -> None:
    # FULL_SHARD frees after forward, so every recompute gathers again (after the
    # pre-backward gather, or as that gather); with the old rule in full precision.
    # Block 0 is never kept gathered, so its gradients differ in every mode.
    cases = [("FULL_SHARD", "weights", mode) for mode in MODES]
    for result in run_ranks(_worker, 2, cases, True):
        for case in cases:
            assert "0: blocks.0.fc.weight" in result[case], (case, result[case])
