"""Lightning's own ``Trainer`` and ``FSDPStrategy`` driving shardwrap after ``install()``.

Worker-side helpers for ``test_lightning.py``. The ranks are already in their gloo group
and carry torchrun's variables, so Lightning neither launches processes nor initialises
the group: it runs its FSDP strategy's code unchanged, which builds torch's
``FullyShardedDataParallel`` by name (shardwrap's after ``install()``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import shardwrap
from tests import models
from tests.dist.hf_frameworks import set_launcher_env

NUM_SAMPLES = 8  # per rank and epoch: 4 steps of 2


def make_module(fsdp2: bool = False):
    """The LightningModule (a TinyGPT); ``fsdp2``: the one FSDP2 users write for
    ``ModelParallelStrategy``, sharding itself in ``configure_model``."""
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1234)
            self.gpt = models.TinyGPT(depth=2)
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, _index):
            loss = models.gpt_loss(self.gpt, batch)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def train_dataloader(self):
            pairs = [models.gpt_batch(seed, batch=1) for seed in range(2 * NUM_SAMPLES)]
            data = torch.utils.data.TensorDataset(
                torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
            )
            return torch.utils.data.DataLoader(data, batch_size=2)

    if not fsdp2:
        return GPTModule()

    class FSDP2GPTModule(GPTModule):
        def __init__(self) -> None:
            super().__init__()
            # Its optional branch would get no gradient: AdamW keeps no state for it, which
            # Lightning's resume then asks the checkpoint for (torch's FSDP2 fails alike).
            del self.gpt.extra

        def configure_model(self) -> None:
            # Imported when it runs, so shardwrap.install() decides whose it is.
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.gpt.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.gpt, mesh=mesh)

    return FSDP2GPTModule()


def make_trainer(strategy_name: str, max_steps: int):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's FSDP strategy, unchanged: Lightning checks for exactly its class
        before refusing a CPU accelerator, as accelerate only picks FSDP on GPUs."""

    if strategy_name == "fsdp":
        strategy = CPUFSDPStrategy(auto_wrap_policy={models.Block}, state_dict_type="full")
    else:
        strategy = "ddp_find_unused_parameters_true"  # TinyGPT.extra is unused here
    return pl.Trainer(
        accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
        max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True,
    )  # fmt: skip


def mean_losses(module) -> list[float]:
    stacked = torch.stack(module.losses)
    dist.all_reduce(stacked)
    return (stacked / dist.get_world_size()).tolist()


def fit(rank: int, world_size: int, strategy_name: str, max_steps: int, ckpt: str | None):
    set_launcher_env(rank, world_size)
    module = make_module()
    trainer = make_trainer(strategy_name, max_steps)
    trainer.fit(module, ckpt_path=ckpt if ckpt and os.path.exists(ckpt) else None)
    wrapped = trainer.strategy.model
    return module, trainer, wrapped


def first_processes(rank: int, world_size: int, folder: str) -> dict:
    """3 steps under shardwrap's FSDP and under Lightning's DDP, each saved by Lightning."""
    shardwrap.install()
    try:
        module, trainer, wrapped = fit(rank, world_size, "fsdp", 3, None)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        result = {
            "wrapper": type(wrapped).__name__,
            "num_fsdp": len(FSDP.fsdp_modules(wrapped)),
            "fsdp": mean_losses(module),
        }
        trainer.save_checkpoint(os.path.join(folder, "fsdp.ckpt"))
    finally:
        shardwrap.uninstall()
    module, trainer, _ = fit(rank, world_size, "ddp", 3, None)
    result["ddp"] = mean_losses(module)
    trainer.save_checkpoint(os.path.join(folder, "ddp.ckpt"))
    return result


def resumed_processes(rank: int, world_size: int, folder: str) -> dict:
    """Fresh processes: each run resumes its own checkpoint and goes on to step 6."""
    shardwrap.install()
    try:
        module, _, _ = fit(rank, world_size, "fsdp", 6, os.path.join(folder, "fsdp.ckpt"))
        result = {"fsdp": mean_losses(module)}
    finally:
        shardwrap.uninstall()
    module, _, _ = fit(rank, world_size, "ddp", 6, os.path.join(folder, "ddp.ckpt"))
    result["ddp"] = mean_losses(module)
    return result
