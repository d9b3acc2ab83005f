"""Train through ``shardwrap.initialize`` and, side by side, a single-process reference."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import shardwrap
from shardwrap.lr_schedules import WarmupLR
from tests import models
from tests.dist.parity import build_model, check_shards, concat, wrap_policy

LR = 0.01
WARMUP = {"warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}
MICRO_BATCH = 2


def ds_config(stage: int, accumulation: int, clipping: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": WARMUP},
    }


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
    reference = copy.deepcopy(model)
    engine, _, _, _ = shardwrap.initialize(
        model=model,
        config=ds_config(stage, accumulation, clipping),
        auto_wrap_policy=wrap_policy("gpt"),
    )
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_optim = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1)
    ref_sched = WarmupLR(ref_optim, **WARMUP)
    norms = []
    for step in range(num_steps):
        use_extra = step % 2 == 1
        batches = {
            (r, m): models.gpt_batch(1000 * step + 10 * m + r, batch=MICRO_BATCH)
            for r in range(world_size)
            for m in range(accumulation)
        }
        whole = concat([batches[(r, m)] for m in range(accumulation) for r in range(world_size)])
        models.gpt_loss(reference, whole, use_extra=use_extra).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, clipping or float("inf"))))
        ref_optim.step()
        ref_sched.step()
        ref_optim.zero_grad()
        for m in range(accumulation):
            assert engine.is_gradient_accumulation_boundary() == (m == accumulation - 1)
            engine.backward(models.gpt_loss(engine, batches[(rank, m)], use_extra=use_extra))
            engine.step()
        assert engine.global_steps == step + 1
        assert engine.get_lr() == ref_sched.get_last_lr()
        check_shards(engine.module, reference, exact)
    return norms


def train_with_client_optimizer(rank: int, world_size: int) -> None:
    """An SGD built over ``model.parameters()`` before ``initialize`` (DeepSpeed's habit)."""
    model = build_model("mlp")
    reference = copy.deepcopy(model)
    client = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = {"train_batch_size": 4 * world_size, "zero_optimization": {"stage": 1}}
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
        check_shards(engine.module, reference, exact=world_size == 1)


def dataloader_indices(rank: int, world_size: int) -> list[list[int]]:
    """The dataset indices each micro-batch of this rank's loader holds."""
    data = torch.utils.data.TensorDataset(torch.arange(24))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD"}}
    _, _, loader, _ = shardwrap.initialize(
        model=build_model("mlp"), config=config, training_data=data
    )
    loader.sampler.set_epoch(0)
    return [batch[0].tolist() for batch in loader]


def all_cases(rank: int, world_size: int) -> dict:
    """Every engine case in one spawn (spawning costs more than the training)."""
    norms = {
        stage: train_engine_and_reference(
            rank, world_size, stage=stage, accumulation=2, clipping=0.5
        )
        for stage in (0, 1, 2, 3)
    }
    train_with_client_optimizer(rank, world_size)
    indices = dataloader_indices(rank, world_size)
    dist.barrier()
    return {"norms": norms, "indices": indices}
