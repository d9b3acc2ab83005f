"""Workers for 3-D parallelism, TP x PP x DP on one ``(pp, dp, tp)`` mesh (test_threed.py).

The model is a stack of residual MLP blocks (norm, ``fc`` column-wise, ``out`` row-wise:
each TP rank holds half the hidden units; the norm stays a plain, replicated tensor),
then a plain head. Each pipeline stage's module is an ``nn.Sequential`` of its slice of
the layers under their names in the whole model, split by torch's ``parallelize_module``
over ``mesh["tp"]``, wrapped in ``ShardedModule`` over ``mesh["dp"]`` and driven by
torch's schedules through ``ShardedPipelineStage`` over ``mesh["pp"]``. World rank ``r``
is pipeline rank ``r // (dp * tp)``, data-parallel rank ``(r // tp) % dp`` and
tensor-parallel rank ``r % tp``, as ``init_device_mesh`` lays them out. The TP ranks of a
data-parallel index see the same microbatches; the reference is the unparallelized model
trained in one process on the global batch.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardwrap
from shardwrap.features.pipeline_stage import ShardedPipelineStage
from shardwrap.policies import ModuleWrapPolicy
from tests.dist.pipeline_cases import dp_mean_loss, run_schedule
from tests.dist.tp_cases import model_state_bytes
from tests.tolerances import REORDER_SAFE_ADAMW

PP, DP, TP = 2, 2, 2
DIM, HIDDEN, NUM_BLOCKS = 8, 16, 4  # blocks 0..3, then the head (layer 4)
# Two microbatches give 1F1B and GPipe each phase (warm-up, steady, cool-down) with two
# stages, and three steps show steps after the first (gathers in the recorded order):
# the properties need no more, and every step costs 8 ranks many collectives.
MICRO_BATCH, NUM_MICROBATCHES, NUM_STEPS = 2, 2, 3
CKPT_STEPS = 2  # steps the plain data-parallel run trains before saving the reverse case
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# (strategy, schedule, infer): ZeRO-3, ZeRO-2 and ZeRO-1 under both schedules between
# them; ``infer``: the stage infers what flows between stages from a real first forward
# and backward (with DTensor parameters) instead of being told.
CASES = (
    ("FULL_SHARD", "1f1b", False),
    ("SHARD_GRAD_OP", "gpipe", True),
    ("SHARD_OPTIM", "1f1b", False),
)
SAVED_CASE = CASES[0]  # the one whose final state is saved


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.out = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.norm(x))))


def whole_model(seed: int = 4321) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(Block() for _ in range(NUM_BLOCKS)), nn.Linear(DIM, DIM))


def stage_layers(pp_rank: int) -> range:
    """Stage 0: blocks 0-1; stage 1: blocks 2-3 and the head."""
    return range(0, 2) if pp_rank == 0 else range(2, NUM_BLOCKS + 1)


def global_batch(step: int, dp: int = DP) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    rows = dp * NUM_MICROBATCHES * MICRO_BATCH
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def local_batch(step: int, dp_rank: int, dp: int = DP):
    x, y = global_batch(step, dp)
    rows = x.shape[0] // dp
    return x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]


def reference_run() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Single-process training on the global batches: losses, final parameters and
    each step's sum of gradient magnitudes (for ``tolerances.reordered_loss_atols``)."""
    model = whole_model()
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    losses, grad_l1s = [], []
    for step in range(NUM_STEPS):
        x, y = global_batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_l1s.append(sum(float(g.abs().sum()) for g in grads))
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grad_l1s


def build_stage(strategy: str, seed: int = 4321, infer: bool = False):
    """This rank's stage: TP over ``mesh["tp"]``, ZeRO over ``mesh["dp"]``, PP over
    ``mesh["pp"]``; returns ``(mesh, stage, sharded module)``."""
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    whole = whole_model(seed)
    layers = stage_layers(pp_rank)
    module = nn.Sequential(OrderedDict((str(i), whole[i]) for i in layers))
    plan = {}
    for i in layers:
        if i < NUM_BLOCKS:
            plan[f"{i}.fc"], plan[f"{i}.out"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(module, mesh["tp"], plan)
    sharded = shardwrap.ShardedModule(
        module,
        device_mesh=mesh["dp"],
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    static = {
        "input_args": (torch.zeros(MICRO_BATCH, DIM, requires_grad=pp_rank > 0),),
        "output_args": (torch.zeros(MICRO_BATCH, DIM, requires_grad=True),),
    }
    stage = ShardedPipelineStage(
        sharded,
        pp_rank,
        PP,
        torch.device("cpu"),
        group=mesh["pp"].get_group(),
        **({} if infer else static),
    )
    return mesh, stage, sharded


def train(strategy: str, schedule: str, infer: bool, save_to: str | None = None) -> dict:
    """NUM_STEPS AdamW steps of NUM_MICROBATCHES microbatches: the global batch's loss per
    step (last stage), gradient reductions per step, the stage's full state at the end."""
    mesh, stage, module = build_stage(strategy, infer=infer)
    dp_rank = mesh["dp"].get_local_rank()
    optim = torch.optim.AdamW(module.parameters(), **REORDER_SAFE_ADAMW)
    sched = SCHEDULES[schedule](stage, n_microbatches=NUM_MICROBATCHES, loss_fn=F.mse_loss)
    losses, reductions = [], []
    for step in range(NUM_STEPS):
        module.comm_ledger.reset()
        x, y = local_batch(step, dp_rank)
        step_losses = run_schedule(sched, x, y, is_first=stage.is_first, is_last=stage.is_last)
        reductions.append(_grad_reductions(module))
        optim.step()
        state_bytes = model_state_bytes(optim)  # with the step's gradients still held
        optim.zero_grad()
        if stage.is_last:
            losses.append(dp_mean_loss(step_losses, mesh["dp"].get_group(), DP))
    if save_to is not None:
        shardwrap.save_checkpoint(save_to, module, optim, extra={"step": NUM_STEPS})
    units = sum(1 for u in module.units if u.handle is not None and u.handle.has_trainable_params)
    return {
        "losses": losses,
        "reductions": reductions,
        "units": units,
        "model_state_bytes": state_bytes,
        "pp_rank": mesh["pp"].get_local_rank(),
        **full_state(module, optim),
    }


def local_numel(pp_rank: int) -> int:
    """Parameter elements one TP rank of stage ``pp_rank`` holds: ``fc`` (column-wise:
    weight and bias) and ``out.weight`` (row-wise) / TP, the rest whole."""
    whole = whole_model()
    total = 0
    for i in stage_layers(pp_rank):
        for name, param in whole[i].named_parameters():
            split = i < NUM_BLOCKS and (name.startswith("fc.") or name == "out.weight")
            total += param.numel() // TP if split else param.numel()
    return total


def _grad_reductions(module) -> dict:
    """The step's gradient reductions: how many, and the sizes of the groups they spanned."""
    records = [
        r
        for r in module.comm_ledger.records
        if r.purpose == "grads" and r.kind in ("reduce_scatter", "all_reduce")
    ]
    return {"count": len(records), "group_sizes": sorted({r.group_size for r in records})}


def full_state(module, optim) -> dict:
    """Whole (global-shape) parameters and optimizer state by name."""
    osd = shardwrap.ShardedModule.optim_state_dict(module, optim)
    return {"model": dict(module.state_dict()), "optim": osd["state"]}


def train_worker(rank: int, world_size: int, save_to: str) -> dict:
    """Every case on the 8 ranks; the saved case also writes a checkpoint to ``save_to``."""
    return {case: train(*case, save_to=save_to if case == SAVED_CASE else None) for case in CASES}


def load_worker(rank: int, world_size: int, strategy: str, path: str) -> dict:
    """Fresh 3-D stages (other initial values), load ``path``; the stage's whole state."""
    _, _, module = build_stage(strategy, seed=99)
    optim = torch.optim.AdamW(module.parameters(), lr=0.01)
    extra = shardwrap.load_checkpoint(path, module, optim)
    return {**full_state(module, optim), "extra": extra}


# --------------------------------------------------------- plain data parallelism
def _dp_loaded(path: str):
    """A plain ZeRO-1 model and optimizer from fresh values, ``path`` loaded into them."""
    module = shardwrap.ShardedModule(
        whole_model(seed=99),
        sharding_strategy="SHARD_OPTIM",
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    optim = torch.optim.AdamW(module.parameters(), lr=0.01)
    return module, optim, shardwrap.load_checkpoint(path, module, optim)


def dp_load_then_save(rank: int, world_size: int, path: str, save_to: str) -> dict:
    """Plain DP (ZeRO-1, ``world_size`` ranks): load the 3-D checkpoint (``"loaded"``),
    train CKPT_STEPS more steps and save (``"saved"``): the reverse direction's input."""
    module, optim, extra = _dp_loaded(path)
    loaded = {**full_state(module, optim), "extra": extra}
    for step in range(CKPT_STEPS):
        x, y = local_batch(step, rank, world_size)
        F.mse_loss(module(x), y).backward()
        optim.step()
        optim.zero_grad()
    shardwrap.save_checkpoint(save_to, module, optim, extra={"step": NUM_STEPS + CKPT_STEPS})
    return {"loaded": loaded, "saved": full_state(module, optim)}


# ------------------------------------- TP replicas that hold no tensor-parallel parameter
def tp_replicas_save(rank: int, world_size: int, path: str) -> dict:
    """A (dp=2, tp=2) mesh whose model has no DTensor parameter (as a stage of plain
    layers in a TP job): the two TP ranks of each DP index hold identical ZeRO-3 shards,
    and the checkpoint must take each range once. Trains 2 steps, saves; the whole state."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module = shardwrap.ShardedModule(
        whole_model(), device_mesh=mesh["dp"], auto_wrap_policy=ModuleWrapPolicy({Block})
    )
    optim = torch.optim.AdamW(module.parameters(), lr=0.01)
    for step in range(CKPT_STEPS):
        x, y = local_batch(step, mesh["dp"].get_local_rank(), 2)
        F.mse_loss(module(x), y).backward()
        optim.step()
        optim.zero_grad()
    shardwrap.save_checkpoint(path, module, optim, extra={"step": CKPT_STEPS})
    return full_state(module, optim)


def dp_load(rank: int, world_size: int, path: str) -> dict:
    """Plain DP (ZeRO-1, ``world_size`` ranks), fresh values: load; the whole state."""
    module, optim, extra = _dp_loaded(path)
    return {**full_state(module, optim), "extra": extra}
