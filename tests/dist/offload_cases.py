"""CPUOffload(offload_params=True) against the same training without offload.

On CPU the host staging copies (see [Note: host shards and staging]) still run, so every
case trains three models side by side: the unsharded reference, the sharded model
without offload, and the offloaded one, which must equal the second bit for bit.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import shardwrap
from shardwrap.checkpoint import load_checkpoint, save_checkpoint
from tests.dist.engine_cases import ds_config, engine_step
from tests.dist.parity import (
    batch_for,
    build_model,
    check_step,
    concat,
    gradient_l1,
    loss_for,
    make_optimizer,
    wrap_policy,
)

OFFLOAD = shardwrap.CPUOffload(offload_params=True)
NUM_STEPS = 3


def _wrap(model, strategy: str, offload: bool, precision=None) -> shardwrap.ShardedModule:
    return shardwrap.ShardedModule(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=wrap_policy("gpt"),
        cpu_offload=OFFLOAD if offload else None,
        mixed_precision=precision,
    )


def _storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.size()


def _apart(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether the two tensors' storages do not overlap (an empty storage overlaps nothing)."""
    (a0, a1), (b0, b1) = _storage_span(tensor), _storage_span(other)
    return a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1


def check_placement(sharded: shardwrap.ShardedModule, optim: torch.optim.Optimizer) -> int:
    """Shards, gradients and optimizer state in host memory, apart from flat_full.

    Returns how many optimizer state tensors it checked.
    """
    pinned = torch.cuda.is_available()
    checked = 0
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        assert handle.host_staging is not None and handle.separate_full, unit.name
        assert handle.flat_shard.device.type == "cpu"
        assert handle.flat_shard.is_pinned() == pinned
        assert _apart(handle.flat_shard, handle.flat_full), unit.name
        if not unit.strategy.free_after_backward:  # the planner's device copy, even one shard
            full_bytes = handle.layout.padded_numel * handle.flat_full.element_size()
            assert handle.full_storage_bytes == full_bytes, unit.name
        for param in handle.shard_params:
            assert param.device.type == "cpu"
            assert (
                param.untyped_storage().data_ptr() == handle.flat_shard.untyped_storage().data_ptr()
            )
            if param.grad is not None:
                assert param.grad.device.type == "cpu" and _apart(param.grad, handle.flat_full)
            for value in optim.state.get(param, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert value.device.type == "cpu" and _apart(value, handle.flat_full)
                    checked += 1
    return checked


def _assert_same(offloaded, plain, what: str) -> None:
    for (name, got), (_, expected) in zip(
        offloaded.named_parameters(), plain.named_parameters(), strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"{what} {name}")


def offload_matches_plain(rank: int, world_size: int, strategy: str, precision=None) -> list:
    """NUM_STEPS AdamW steps: offloaded == plain bit for bit, both close to the reference."""
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    plain = _wrap(copy.deepcopy(model), strategy, False, precision)
    offloaded = _wrap(model, strategy, True, precision)
    optims = [make_optimizer(m, "adamw") for m in (reference, plain, offloaded)]
    losses = []
    for step in range(NUM_STEPS):
        batches = [batch_for("gpt", 1000 * step + r) for r in range(world_size)]
        ref_loss = loss_for("gpt", reference, concat(batches), step)
        ref_loss.backward()
        grad_l1 = gradient_l1(reference)
        step_losses = [loss_for("gpt", m, batches[rank], step) for m in (plain, offloaded)]
        for loss in step_losses:
            loss.backward()
        assert torch.equal(step_losses[0], step_losses[1])
        for optim in optims:
            optim.step()
        _assert_same(offloaded, plain, f"{strategy} step {step}")
        assert check_placement(offloaded, optims[2]) > 0
        for optim in optims:
            optim.zero_grad()
        if precision is None:  # low precision stays within its own tolerance of fp32
            mean_loss = step_losses[1].detach().clone()
            dist.all_reduce(mean_loss)
            check_step(
                offloaded, reference, mean_loss / world_size, ref_loss, world_size=world_size,
                optimizer="adamw", steps=step + 1, grad_l1=grad_l1,
            )  # fmt: skip
        losses.append(float(step_losses[1].detach()))
    return losses


BF16 = shardwrap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
# (label, strategy, mixed precision): every ZeRO stage, data parallel, and bf16.
STRATEGY_CASES = {
    "FULL_SHARD": ("FULL_SHARD", None),
    "SHARD_GRAD_OP": ("SHARD_GRAD_OP", None),
    "SHARD_OPTIM": ("SHARD_OPTIM", None),
    "NO_SHARD": ("NO_SHARD", None),
    "bf16 FULL_SHARD": ("FULL_SHARD", BF16),
    "bf16 NO_SHARD": ("NO_SHARD", BF16),
}


def strategies(rank: int, world_size: int) -> dict[str, list[float]]:
    """Every case of ``STRATEGY_CASES`` in one spawn; each one's local losses."""
    return {
        label: offload_matches_plain(rank, world_size, strategy, precision)
        for label, (strategy, precision) in STRATEGY_CASES.items()
    }


def checkpoint_roundtrip(rank: int, world_size: int, path: str) -> None:
    """Save an offloaded run, load into a fresh offloaded model; it continues identically."""
    model = build_model("gpt")
    saved = _wrap(model, "FULL_SHARD", True)
    saved_optim = make_optimizer(saved, "adamw")
    for step in range(2):
        loss_for("gpt", saved, batch_for("gpt", 100 * step + rank), step).backward()
        saved_optim.step()
        saved_optim.zero_grad()
    save_checkpoint(path, saved, saved_optim, extra={"step": 2})
    torch.manual_seed(99)  # the fresh model starts elsewhere
    fresh = _wrap(type(model)(), "FULL_SHARD", True)
    fresh_optim = make_optimizer(fresh, "adamw")
    assert load_checkpoint(path, fresh, fresh_optim) == {"step": 2}
    _assert_same(fresh, saved, "loaded")
    for got, expected in zip(fresh.parameters(), saved.parameters(), strict=True):
        for name, value in saved_optim.state[expected].items():
            loaded = fresh_optim.state[got][name]
            torch.testing.assert_close(loaded, value, rtol=0, atol=0, msg=name)
    assert check_placement(fresh, fresh_optim) > 0
    full = [m.state_dict() for m in (fresh, saved)]
    for name, value in full[1].items():
        torch.testing.assert_close(full[0][name], value, rtol=0, atol=0, msg=name)
    plain = _wrap(type(model)(), "SHARD_GRAD_OP", False)  # the format does not know offload
    load_checkpoint(path, plain, make_optimizer(plain, "adamw"))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, full[1][name], rtol=0, atol=0, msg=name)
    for optim, sharded in ((fresh_optim, fresh), (saved_optim, saved)):
        loss_for("gpt", sharded, batch_for("gpt", 500 + rank), 0).backward()
        optim.step()
    _assert_same(fresh, saved, "after resuming")
    summon_writes_back(fresh)


def summon_writes_back(sharded: shardwrap.ShardedModule) -> None:
    """Edits of summoned full parameters reach the host shards (gathered on the device)."""
    before = sharded.state_dict()
    with shardwrap.ShardedModule.summon_full_params(sharded, writeback=True):
        with torch.no_grad():
            for param in sharded.parameters():
                param.mul_(0.5)
    after = sharded.state_dict()
    halved = {name for name, _ in sharded.named_parameters(remove_duplicate=False)}
    assert halved
    for name, value in before.items():
        expected = value * 0.5 if name in halved else value
        torch.testing.assert_close(after[name], expected, rtol=0, atol=0, msg=name)


def engine_offload_matches_memory(rank: int, world_size: int, stage: int, key: str) -> None:
    """``zero_optimization.<key>: {device: cpu}`` steps exactly like the run without it."""
    model = build_model("gpt")
    runs = []
    for offload in (False, True):
        config = ds_config(stage, 2, 0.5)
        zero = {"stage": stage, key: {"device": "cpu"}} if offload else {"stage": stage}
        config["zero_optimization"] = zero
        engine, optim, _, _ = shardwrap.initialize(
            model=copy.deepcopy(model) if not offload else model,
            config=config,
            auto_wrap_policy=wrap_policy("gpt"),
        )
        runs.append((engine, optim))
    (plain, _), (offloaded, optim) = runs
    assert offloaded.module.cpu_offload == OFFLOAD
    for step in range(2):
        engine_step(plain, rank, step, world_size, 2)
        engine_step(offloaded, rank, step, world_size, 2)
        _assert_same(offloaded.module, plain.module, f"stage {stage} {key} step {step}")
    assert check_placement(offloaded.module, optim) > 0


def engine_cases(rank: int, world_size: int) -> None:
    for stage, key in ((1, "offload_optimizer"), (2, "offload_optimizer"), (3, "offload_param")):
        engine_offload_matches_memory(rank, world_size, stage, key)


def checkpoint_and_engine(rank: int, world_size: int, path: str) -> None:
    """The checkpoint round trip and the engine's offload keys, in one spawn."""
    checkpoint_roundtrip(rank, world_size, path)
    engine_cases(rank, world_size)
