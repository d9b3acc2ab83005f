"""Lightning's ``ModelParallelStrategy`` running FSDP2 code: torch's ``fully_shard`` and,
after ``shardwrap.install()``, shardwrap's.

Worker-side helpers for ``test_lightning_fsdp2.py``. The ranks are already in their gloo
group with torchrun's variables, so Lightning launches nothing. The LightningModule's
``configure_model`` is what Lightning's docs ask of FSDP2 users: ``fully_shard`` on each
block, then on the root, over the strategy's ``data_parallel`` mesh dimension, imported
from ``torch.distributed.fsdp`` when it runs (so ``install()`` decides whose it is).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import shardwrap
from tests.dist.hf_frameworks import set_launcher_env
from tests.dist.lightning_worker import make_module


def fit(rank: int, world_size: int, max_steps: int, ckpt: str | None):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    set_launcher_env(rank, world_size)
    module = make_module(fsdp2=True)
    strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=True,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt)
    return module, trainer


def _record(module) -> dict:
    """Every rank's losses (averaged over ranks) and every parameter's full value."""
    stacked = torch.stack(module.losses)
    dist.all_reduce(stacked)
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.gpt.named_parameters()
    }
    return {
        "losses": (stacked / dist.get_world_size()).tolist(),
        "params": params,
        "types": sorted(
            {type(m).__name__ for m in module.gpt.modules() if "FSDP" in type(m).__name__}
        ),
        "owner": sorted(
            {
                type(m).__module__.split(".")[0]
                for m in module.gpt.modules()
                if "FSDP" in type(m).__name__
            }
        ),
    }


def run(rank: int, world_size: int, folder: str, door: str) -> dict:
    """3 steps saved by Lightning (a distributed checkpoint), then a resume to step 6 in
    the same processes, with ``door``'s ``fully_shard`` ("torch" or "shardwrap")."""
    if door == "shardwrap":
        shardwrap.install()
    try:
        module, trainer = fit(rank, world_size, 3, None)
        first = _record(module)
        path = os.path.join(folder, f"{door}.ckpt")
        trainer.save_checkpoint(path)
        dist.barrier()
        module, _ = fit(rank, world_size, 6, path)
        return {"first": first, "resumed": _record(module)}
    finally:
        if door == "shardwrap":
            shardwrap.uninstall()
