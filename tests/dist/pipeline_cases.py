"""Workers for the pipeline x data parallel tests: torch's schedules over ShardedModule stages.

The model is a tiny MLP, an ``nn.Sequential`` of Linear/Tanh layers. Each stage's module is
an ``nn.Sequential`` of its slice of the layers under their names in the whole model (the
torchtitan convention), so parameter names, checkpoints and the reference all agree. World
rank ``r`` is pipeline rank ``r // dp`` and data-parallel rank ``r % dp``, as
``init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))`` lays them out.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import shardwrap
from shardwrap.ckpt.pretrained import load_pretrained
from shardwrap.features.pipeline_stage import ShardedPipelineStage
from shardwrap.policies import ModuleWrapPolicy
from tests.tolerances import REORDER_SAFE_ADAMW

DIM = 8
NUM_LINEAR = 4
MICRO_BATCH = 2
NUM_MICROBATCHES = 4
NUM_STEPS = 5
GRAD_PURPOSES = ("grads",)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def whole_model() -> nn.Sequential:
    """Linear, Tanh, Linear, Tanh, ..., Linear: ``2 * NUM_LINEAR - 1`` layers."""
    torch.manual_seed(4321)
    layers: list[nn.Module] = []
    for i in range(NUM_LINEAR):
        layers.append(nn.Linear(DIM, DIM))
        if i < NUM_LINEAR - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def layer_ranges(num_stages: int) -> list[tuple[int, int]]:
    """Split the layers into ``num_stages`` contiguous runs of Linear (+ Tanh) pairs."""
    pairs = [(2 * i, min(2 * i + 2, 2 * NUM_LINEAR - 1)) for i in range(NUM_LINEAR)]
    per = NUM_LINEAR // num_stages
    return [(pairs[s * per][0], pairs[(s + 1) * per - 1][1]) for s in range(num_stages)]


def stage_module(whole: nn.Sequential, start: int, stop: int) -> nn.Sequential:
    """Layers ``[start, stop)`` of ``whole`` under their names in ``whole``."""
    return nn.Sequential(OrderedDict((str(i), whole[i]) for i in range(start, stop)))


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    rows = dp * NUM_MICROBATCHES * MICRO_BATCH
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def local_batch(step: int, dp: int, dp_rank: int):
    x, y = global_batch(step, dp)
    rows = NUM_MICROBATCHES * MICRO_BATCH
    return x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]


def run_schedule(sched, x, y, *, is_first: bool, is_last: bool) -> list[torch.Tensor]:
    """One step of ``sched``: the first stage feeds ``x``, the last gets the targets ``y``;
    the last stage's microbatch losses (empty elsewhere)."""
    step_losses: list[torch.Tensor] = []
    sched.step(
        *((x,) if is_first else ()),
        target=y if is_last else None,
        losses=step_losses if is_last else None,
    )
    return step_losses


def dp_mean_loss(step_losses: list[torch.Tensor], dp_group, dp: int) -> float:
    """The global batch's loss: the microbatches' mean, averaged over the DP ranks."""
    mean = torch.stack(step_losses).mean().reshape(1)
    dist.all_reduce(mean, group=dp_group)
    return float(mean.detach()) / dp


def reference_run(dp: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Single-process training on the same global batches: losses, final parameters and
    each step's sum of gradient magnitudes (for ``tolerances.reordered_loss_atols``)."""
    model = whole_model()
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    losses, grad_l1s = [], []
    for step in range(NUM_STEPS):
        x, y = global_batch(step, dp)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_l1s.append(sum(float(g.abs().sum()) for g in grads))
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, grad_l1s


def build_stages(pp: int, dp: int, strategy: str, virtual: int, keep_gathered: bool):
    """This rank's stage modules (``virtual`` per pipeline rank, looped), wrapped over dp."""
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    ranges = layer_ranges(pp * virtual)
    whole = whole_model()
    stages, wrapped = [], []
    for index in range(pp_rank, pp * virtual, pp):
        sharded = shardwrap.ShardedModule(
            stage_module(whole, *ranges[index]),
            device_mesh=mesh["dp"],
            sharding_strategy=strategy,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        )
        if keep_gathered:
            sharded.set_reshard_after_forward(False, root_only=False)
        # Static metadata: what flows between stages (and needs a gradient back).
        example_in = torch.zeros(MICRO_BATCH, DIM, requires_grad=index > 0)
        example_out = torch.zeros(MICRO_BATCH, DIM, requires_grad=True)
        stage = ShardedPipelineStage(
            sharded,
            index,
            pp * virtual,
            torch.device("cpu"),
            input_args=(example_in,),
            output_args=(example_out,),
            group=mesh["pp"].get_group(),
        )
        stages.append(stage)
        wrapped.append(sharded)
    return mesh, stages, wrapped


def pipeline_worker(rank: int, world_size: int, pp: int, cases: list[tuple]) -> dict:
    """``train`` for each ``(strategy, schedule, keep_gathered)`` case, by case."""
    return {case: train(world_size, pp, *case) for case in cases}


def train(world_size: int, pp: int, strategy: str, schedule: str, keep_gathered: bool) -> dict:
    """Train NUM_STEPS steps: the mean loss per step (last stage), the ledger's counts per
    step, and the stage's full parameters at the end."""
    dp = world_size // pp
    virtual = 2 if schedule == "interleaved" else 1
    mesh, stages, wrapped = build_stages(pp, dp, strategy, virtual, keep_gathered)
    dp_rank = mesh["dp"].get_local_rank()
    params = [p for m in wrapped for p in m.parameters()]
    optim = torch.optim.AdamW(params, **REORDER_SAFE_ADAMW)
    stage_arg = stages if virtual > 1 else stages[0]
    sched = SCHEDULES[schedule](stage_arg, n_microbatches=NUM_MICROBATCHES, loss_fn=F.mse_loss)
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    losses, counts = [], []
    for step in range(NUM_STEPS):
        for m in wrapped:
            m.comm_ledger.reset()
        x, y = local_batch(step, dp, dp_rank)
        step_losses = run_schedule(sched, x, y, is_first=is_first, is_last=is_last)
        counts.append([_ledger_counts(m) for m in wrapped])
        optim.step()
        optim.zero_grad()
        if is_last:
            losses.append(dp_mean_loss(step_losses, mesh["dp"].get_group(), dp))
    final = {}
    for m in wrapped:
        final.update({k: v.clone() for k, v in m.state_dict().items()})
    return {"losses": losses, "counts": counts, "final": final, "dp_rank": dp_rank}


def _ledger_counts(module) -> dict:
    ledger = module.comm_ledger
    grad_records = [
        r
        for r in ledger.records
        if r.purpose in GRAD_PURPOSES and r.kind in ("reduce_scatter", "all_reduce")
    ]
    per_unit: dict[str, int] = {}
    for r in grad_records:
        per_unit[r.unit] = per_unit.get(r.unit, 0) + 1
    return {
        "grad_reductions": per_unit,
        "grad_bytes": sum(r.num_bytes for r in grad_records),
        "gathers": ledger.count("all_gather", "params"),
        "gather_bytes": ledger.bytes("all_gather", "params"),
        "presence_votes": ledger.count("all_reduce", "grad_presence"),
        "units": sorted(
            u.handle.comm_label
            for u in module.units
            if u.handle is not None and u.handle.has_trainable_params
        ),
    }


# ----------------------------------------------------------------- checkpoints (PP x DP)
CKPT_STEPS = 2


def _full_state(module, optim) -> dict:
    """Whole parameters and optimizer state by name (this rank's stage, or the model)."""
    osd = shardwrap.ShardedModule.optim_state_dict(module, optim)
    return {"model": dict(module.state_dict()), "optim": osd["state"]}


def pp_save_worker(rank: int, world_size: int, pp: int, strategy: str, path: str) -> dict:
    """Train the stages CKPT_STEPS steps, save; the stage's whole state as saved."""
    dp = world_size // pp
    mesh, (stage,), (module,) = build_stages(pp, dp, strategy, 1, False)
    optim = torch.optim.AdamW(module.parameters(), lr=0.01)
    sched = ScheduleGPipe(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=F.mse_loss)
    for step in range(CKPT_STEPS):
        x, y = local_batch(step, dp, mesh["dp"].get_local_rank())
        sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
        optim.step()
        optim.zero_grad()
    shardwrap.save_checkpoint(path, module, optim, extra={"step": CKPT_STEPS})
    return _full_state(module, optim)


def pp_load_worker(rank: int, world_size: int, pp: int, strategy: str, path: str) -> dict:
    """Fresh stages (other initial values), load the checkpoint; the stage's whole state."""
    _, _, (module,) = build_stages(pp, world_size // pp, strategy, 1, False)
    with torch.no_grad():
        for param in module.parameters():
            param.fill_(7.0)
    optim = torch.optim.AdamW(module.parameters(), lr=0.01)
    extra = shardwrap.load_checkpoint(path, module, optim)
    return {**_full_state(module, optim), "extra": extra}


def pp_pretrained_worker(rank: int, world_size: int, pp: int, folder: str) -> dict:
    """Fresh FULL_SHARD stages, ``load_pretrained`` of a Hugging Face folder; the stage's
    whole parameters."""
    _, _, (module,) = build_stages(pp, world_size // pp, "FULL_SHARD", 1, False)
    load_pretrained(module, folder)
    return dict(module.state_dict())


def _plain_dp(strategy: str):
    module = shardwrap.ShardedModule(
        whole_model(), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    return module, torch.optim.AdamW(module.parameters(), lr=0.01)


def dp_save_worker(rank: int, world_size: int, strategy: str, path: str) -> dict:
    """Plain data parallelism: train CKPT_STEPS steps on the global batch, save."""
    module, optim = _plain_dp(strategy)
    rows = NUM_MICROBATCHES * MICRO_BATCH
    for step in range(CKPT_STEPS):
        x, y = global_batch(step, world_size)
        F.mse_loss(
            module(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows]
        ).backward()
        optim.step()
        optim.zero_grad()
    shardwrap.save_checkpoint(path, module, optim, extra={"step": CKPT_STEPS})
    return _full_state(module, optim)


def dp_load_worker(rank: int, world_size: int, strategy: str, path: str) -> dict:
    """Plain data parallelism at any world size: load; the model's whole state."""
    module, optim = _plain_dp(strategy)
    extra = shardwrap.load_checkpoint(path, module, optim)
    return {**_full_state(module, optim), "extra": extra}


# ------------------------------------------- hand-written accumulation with the controls
def accumulation_worker(rank: int, world_size: int) -> dict:
    """Two micro-batches, FSDP2-style (no sync, no reshard after backward, then both on),
    with and without keeping; the second micro-batch's all-gathers and the gradients'
    distance from one big batch's."""
    results = {}
    for keep in (False, True):
        reference = whole_model()
        module = shardwrap.ShardedModule(
            copy.deepcopy(reference), auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
        )
        x, y = global_batch(0, world_size)
        rows = x.shape[0] // world_size
        mine = slice(rank * rows, (rank + 1) * rows)
        halves = list(zip(x[mine].chunk(2), y[mine].chunk(2), strict=True))
        for index, (xs, ys) in enumerate(halves):
            last = index == len(halves) - 1
            module.set_requires_gradient_sync(last)
            module.set_reshard_after_backward(last or not keep)
            module.comm_ledger.reset()
            (F.mse_loss(module(xs), ys) / len(halves)).backward()
        F.mse_loss(reference(x), y).backward()
        sharded_grads = {
            name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None
        }
        with shardwrap.ShardedModule.summon_full_params(module, with_grads=True):
            full = {name: p.grad.clone() for name, p in module.named_parameters()}
        ref = {name: p.grad for name, p in reference.named_parameters()}
        results[keep] = {
            "gathers": module.comm_ledger.count("all_gather", "params"),
            "full_grads": full,
            "reference": ref,
            "had_grads": sorted(sharded_grads),
        }
    return results
