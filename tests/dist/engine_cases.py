"""Train through ``shardwrap.initialize`` and, side by side, a single-process reference."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import shardwrap
from shardwrap.deepspeed.lr_schedules import WarmupLR
from shardwrap.planner.estimate import STAGE_STRATEGIES
from shardwrap.runtime.step import reduce_deferred_grads_for
from tests import models
from tests.dist import parity
from tests.dist.parity import build_model, check_shards, concat, reordered_tol, wrap_policy
from tests.tolerances import ADAMW_EPS

LR = 0.01
WARMUP = {"warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}
MICRO_BATCH = 2
TOKENS_PER_MICRO_BATCH = MICRO_BATCH * 16  # models.gpt_batch's sequence length


def ds_config(stage: int, accumulation: int, clipping: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "zero_optimization": {"stage": stage},
        # eps: a reordered reference's bound (tests/tolerances.py)
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": ADAMW_EPS, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": WARMUP},
    }


def micro_batches(step: int, world_size: int, accumulation: int) -> dict:
    """``{(rank, micro_step): batch}`` for one optimizer step."""
    return {
        (r, m): models.gpt_batch(1000 * step + 10 * m + r, batch=MICRO_BATCH)
        for r in range(world_size)
        for m in range(accumulation)
    }


class Reference:
    """The unsharded model, stepped once per engine step on the whole effective batch."""

    def __init__(self, model: torch.nn.Module, clipping: float) -> None:
        self.model = model
        self.clipping = clipping
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=LR, eps=ADAMW_EPS, weight_decay=0.1)
        self.scheduler = WarmupLR(self.optimizer, **WARMUP)

    def step(self, step: int, world_size: int, accumulation: int) -> float:
        batches = micro_batches(step, world_size, accumulation)
        order = [batches[(r, m)] for m in range(accumulation) for r in range(world_size)]
        models.gpt_loss(self.model, concat(order), use_extra=step % 2 == 1).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.clipping or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return float(norm)


def engine_tol(num_steps: int, world_size: int, accumulation: int, clipping: float) -> dict:
    """Parameters after ``num_steps`` engine steps against :class:`Reference`: AdamW at
    ``LR`` (the warm-up only lowers it) on ``world_size * accumulation`` micro-batches."""
    tokens = TOKENS_PER_MICRO_BATCH * world_size * accumulation
    numel = parity.trainable_numel(build_model("gpt"))
    multiple = parity.clipped_grad_multiple(numel, clipping, tokens=tokens) if clipping else 1.0
    return reordered_tol("adamw", num_steps, tokens, grad_multiple=multiple, lr=LR)


def check_engine(engine, reference: Reference, num_steps: int, world_size: int, **kw) -> None:
    """:func:`check_shards` within :func:`engine_tol` (accumulation 2, clipping 0.5)."""
    tol = engine_tol(num_steps, world_size, kw.get("accumulation", 2), kw.get("clipping", 0.5))
    check_shards(engine.module, reference.model, exact=False, tol=tol)


def engine_step(engine, rank: int, step: int, world_size: int, accumulation: int) -> None:
    batches = micro_batches(step, world_size, accumulation)
    for m in range(accumulation):
        assert engine.is_gradient_accumulation_boundary() == (m == accumulation - 1)
        loss = models.gpt_loss(engine, batches[(rank, m)], use_extra=step % 2 == 1)
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == step + 1


def make_engine(model, stage: int, accumulation: int, clipping: float, **precision):
    engine, _, _, _ = shardwrap.initialize(
        model=model,
        config={**ds_config(stage, accumulation, clipping), **precision},
        auto_wrap_policy=wrap_policy("gpt"),
    )
    return engine


def train_engine_and_reference(
    rank: int,
    world_size: int,
    *,
    stage: int,
    accumulation: int,
    clipping: float,
    exact: bool = False,
    num_steps: int = 3,
) -> list[float]:
    """Engine steps against a reference that sees the whole effective batch at once.

    Returns the reference's gradient norms (before clipping), one per step.
    """
    model = build_model("gpt")
    reference = Reference(copy.deepcopy(model), clipping)
    engine = make_engine(model, stage, accumulation, clipping)
    norms = []
    for step in range(num_steps):
        norms.append(reference.step(step, world_size, accumulation))
        engine_step(engine, rank, step, world_size, accumulation)
        assert engine.get_lr() == reference.scheduler.get_last_lr()
        if exact:
            check_shards(engine.module, reference.model, exact=True)
        else:
            tol = engine_tol(step + 1, world_size, accumulation, clipping)
            check_shards(engine.module, reference.model, exact=False, tol=tol)
    return norms


def train_with_client_optimizer(rank: int, world_size: int) -> None:
    """An SGD built over ``model.parameters()`` before ``initialize`` (DeepSpeed's habit)."""
    model = build_model("mlp")
    reference = copy.deepcopy(model)
    client = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = {
        "train_batch_size": 4 * world_size,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.0,  # the reference does not clip (DeepSpeed's default is 1.0)
    }
    engine, optim, _, scheduler = shardwrap.initialize(
        model=model, optimizer=client, config=config, auto_wrap_policy=wrap_policy("mlp")
    )
    assert optim is client and scheduler is None
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        batches = [models.mlp_batch(100 * step + r) for r in range(world_size)]
        models.mlp_loss(reference, concat(batches)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        engine.backward(models.mlp_loss(engine, batches[rank]))
        engine.step()
        if world_size == 1:
            check_shards(engine.module, reference, exact=True)
        else:  # no weight decay here: parity's SGD bound (with it) holds a fortiori
            check_shards(engine.module, reference, exact=False, tol=reordered_tol("sgd", step + 1))


def dataloader_indices(rank: int, world_size: int) -> list[list[int]]:
    """The dataset indices each micro-batch of this rank's loader holds."""
    data = torch.utils.data.TensorDataset(torch.arange(24))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD"}}
    _, _, loader, _ = shardwrap.initialize(
        model=build_model("mlp"), config=config, training_data=data
    )
    loader.sampler.set_epoch(0)
    return [batch[0].tolist() for batch in loader]


def all_cases(rank: int, world_size: int, scratch: str) -> dict:
    """Every engine case in one spawn (spawning costs more than the training)."""
    norms = {
        stage: train_engine_and_reference(
            rank, world_size, stage=stage, accumulation=2, clipping=0.5, num_steps=2
        )
        for stage in (0, 1, 2, 3)
    }
    train_with_client_optimizer(rank, world_size)
    fp16_engine_equals_manual_scaling(rank, world_size, stage=3)  # one rank's inf skips all
    nvme_engine_equals_memory_engine(rank, world_size, scratch, stage=2)
    indices = dataloader_indices(rank, world_size)
    dist.barrier()
    return {"norms": norms, "indices": indices}


RESUME_STAGE = {2: 3, 3: 2}  # save with ZeRO-3 on 2 ranks, resume with ZeRO-2 on 3 ranks


def save_then_resume(
    rank: int, world_size: int, save_dir: str, saved_on: int, asynchronous: bool = False
) -> None:
    """Save after steps 0-1 (on ``saved_on`` ranks); resume and run steps 2-3 here.

    The reference replays steps 0-1 with ``saved_on`` ranks' batches, then 2-3 with ours.
    ``asynchronous``: the engine trains step 2 while the save is written in the background.
    """
    model = build_model("gpt")
    reference = Reference(copy.deepcopy(model), clipping=0.5)
    engine = make_engine(model, RESUME_STAGE[world_size], 2, 0.5)
    for step in range(2):
        reference.step(step, saved_on, 2)
        if world_size == saved_on:
            engine_step(engine, rank, step, world_size, 2)
    if world_size == saved_on:
        handle = engine.save_checkpoint(
            save_dir, client_state={"epoch": 7}, asynchronous=asynchronous
        )
        if asynchronous:
            engine_step(engine, rank, 2, world_size, 2)  # the save holds steps 0-1 only
            assert handle.result() == os.path.join(save_dir, "global_step2")
        engine.save_checkpoint(save_dir, tag="spare", save_latest=False)
        return
    path, client_state = engine.load_checkpoint(save_dir)
    assert path.endswith("global_step2") and client_state == {"epoch": 7}, (path, client_state)
    assert engine.global_steps == 2 and engine.get_lr() == reference.scheduler.get_last_lr()
    # saved on 2 ranks, resumed on 3: the larger world's sums bound both
    check_engine(engine, reference, 2, max(world_size, saved_on))
    for step in range(2, 4):
        reference.step(step, world_size, 2)
        engine_step(engine, rank, step, world_size, 2)
        check_engine(engine, reference, step + 1, max(world_size, saved_on))


def _low_precision_twin(model, stage: int, dtype: torch.dtype) -> shardwrap.ShardedModule:
    """A copy of ``model`` wrapped as the engine's stage would be, computing in ``dtype``."""
    return shardwrap.ShardedModule(
        copy.deepcopy(model),
        sharding_strategy=STAGE_STRATEGIES[stage],
        auto_wrap_policy=wrap_policy("gpt"),
        mixed_precision=shardwrap.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype),
    )


def bf16_engine_equals_sharded_module(rank: int, world_size: int, stage: int) -> None:
    """``bf16: {enabled: true}`` trains exactly like ShardedModule with bf16 MixedPrecision."""
    model = build_model("gpt")
    twin = _low_precision_twin(model, stage, torch.bfloat16)
    engine = make_engine(model, stage, 1, 0.0, bf16={"enabled": True})
    twin_optim = torch.optim.AdamW(twin.parameters(), lr=LR, eps=ADAMW_EPS, weight_decay=0.1)
    twin_sched = WarmupLR(twin_optim, **WARMUP)
    for step in range(3):
        batch = micro_batches(step, world_size, 1)[(rank, 0)]
        models.gpt_loss(twin, batch, use_extra=step % 2 == 1).backward()
        twin_optim.step()
        twin_sched.step()
        twin_optim.zero_grad()
        engine_step(engine, rank, step, world_size, 1)
        for (name, mine), (_, theirs) in zip(
            engine.module.named_parameters(), twin.named_parameters(), strict=True
        ):
            assert mine.dtype == torch.float32, name  # fp32 master shards
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)


def fp16_engine_equals_manual_scaling(rank: int, world_size: int, stage: int) -> None:
    """fp16 trains like ShardedModule(fp16) with the loss scaled by hand; an inf skips a step."""
    model = build_model("gpt")
    twin = _low_precision_twin(model, stage, torch.float16)
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    engine = make_engine(model, stage, 1, 0.0, fp16=fp16)
    twin_optim = torch.optim.AdamW(twin.parameters(), lr=LR, eps=ADAMW_EPS, weight_decay=0.1)
    twin_sched = WarmupLR(twin_optim, **WARMUP)
    scale = torch.tensor(2.0**8, dtype=torch.float32)
    for step in range(2):
        batch = micro_batches(step, world_size, 1)[(rank, 0)]
        (models.gpt_loss(twin, batch, use_extra=step % 2 == 1) * scale).backward()
        reduce_deferred_grads_for(twin_optim)  # ZeRO-1 keeps gradients local until here
        for param in twin.parameters():
            if param.grad is not None:
                param.grad.mul_(1.0 / scale.item())
        twin_optim.step()
        twin_sched.step()
        twin_optim.zero_grad()
        engine_step(engine, rank, step, world_size, 1)
        for (name, mine), (_, theirs) in zip(
            engine.module.named_parameters(), twin.named_parameters(), strict=True
        ):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    before = [p.detach().clone() for p in engine.module.parameters()]
    lr_before = engine.get_lr()
    loss = models.gpt_loss(engine, micro_batches(2, world_size, 1)[(rank, 0)])
    engine.backward(loss * (float("inf") if rank == world_size - 1 else 1.0))
    engine.step()  # one rank overflowed: every rank skips
    assert (engine.global_steps, engine.skipped_steps) == (3, 1)
    assert engine.get_lr() == lr_before and engine.loss_scaler.scale == 2.0**8  # hysteresis 2
    for old, new in zip(before, engine.module.parameters(), strict=True):
        assert torch.equal(old, new.detach())
        assert new.grad is None


def nvme_engine_equals_memory_engine(
    rank: int, world_size: int, path: str, stage: int, offload: tuple[str, ...] = ("optimizer",)
) -> None:
    """``offload_{optimizer,param}: {device: nvme}`` trains exactly like the same run in memory.

    With ``param`` among ``offload``, also a small ``sub_group_size``: the step is streamed.
    """
    model = build_model("gpt")
    in_memory = make_engine(copy.deepcopy(model), stage, 2, 0.5)
    nvme = {"device": "nvme", "nvme_path": path}
    config = {**ds_config(stage, 2, 0.5)}
    config["zero_optimization"] = {"stage": stage, **{f"offload_{k}": nvme for k in offload}}
    if "param" in offload:
        config["zero_optimization"]["sub_group_size"] = 1000
    on_disk, optimizer, _, _ = shardwrap.initialize(
        model=model, config=config, auto_wrap_policy=wrap_policy("gpt")
    )
    store = on_disk.module.disk_store
    assert store is not None
    assert store.sub_group_size == (1000 if "param" in offload else 1_000_000_000)
    for step in range(2):
        engine_step(in_memory, rank, step, world_size, 2)
        engine_step(on_disk, rank, step, world_size, 2)
        for (name, kept), (_, mapped) in zip(
            in_memory.module.named_parameters(), on_disk.module.named_parameters(), strict=True
        ):
            torch.testing.assert_close(mapped, kept, rtol=0, atol=0, msg=name)
    assert (store.num_sub_groups(optimizer) > 1) == ("param" in offload)
