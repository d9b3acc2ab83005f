"""Rank workers for tests/dist/test_fsdp2_door.py: one FSDP2 script, two ``fully_shard`` s.

The script is what FSDP2 client code does: ``fully_shard`` on each block, then on the
root with FSDP2's default ``reshard_after_forward`` (False for the root); AdamW on the
DTensor parameters; torch's ``clip_grad_norm_`` over the DTensor gradients; the
parameters' ``full_tensor()`` and local shapes, and ``model.state_dict()``, read after
every step. It runs once with torch's ``torch.distributed.fsdp.fully_shard`` and once
with ``shardwrap.fully_shard``; the test compares the two records.

The model's row counts are uneven on purpose: at 2 ranks a 1-row bias leaves rank 1's
chunk empty, at 3 ranks a 4-row head leaves rank 2's empty, and most other parameters'
last chunk is short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwrap
from shardwrap.comm import sum_order
from shardwrap.fsdp2.state import state_of
from tests import tolerances

NUM_STEPS = 4
FAILED_STEP = 1  # Script.fail_in's step
LR = 0.02
CLIP_NORM = 0.5  # under the gradients' norm here, so clipping changes every step
VOCAB, DIM, HIDDEN, OUT, SEQ = 37, 10, 7, 4, 6


class Block(nn.Module):
    """Attention-like mixing and an MLP, with uneven row counts."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1)
        x = x + self.proj(attn @ v)
        return x + self.down(torch.tanh(self.up(x)))


class TinyModel(nn.Module):
    def __init__(self, lead_gain: bool = False) -> None:
        super().__init__()
        # lead_gain: a (1, 2) output gain, the root unit's first parameter, then the norm
        # (dense gradients where the gain's padding moves the chunk's start; see Script).
        self.gain = nn.Parameter(torch.full((1, 2), 0.5)) if lead_gain else None
        if lead_gain:
            self.norm = nn.LayerNorm(DIM)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        if not lead_gain:
            self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)  # 4 rows: empty on rank 2 of 3
        self.gate = nn.Linear(DIM, 1)  # bias of 1 row: empty on rank 1 of 2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        out = self.head(x) * torch.sigmoid(self.gate(x))
        return out if self.gain is None else out * self.gain.sum()


def sharded_tiny(side: str, world_size: int) -> TinyModel:
    """The seeded model, each block then the root through ``side``'s ``fully_shard``
    (``"torch"``: torch's; any other side: shardwrap's) on a 1-D mesh of ``world_size``."""
    shard = torch_fsdp.fully_shard if side == "torch" else shardwrap.fully_shard
    torch.manual_seed(0)
    model = TinyModel()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (3, SEQ), generator=g), torch.randint(
        0, OUT, (3, SEQ), generator=g
    )


@dataclass
class Record:
    """What one run shows, step by step, in plain tensors (for pickling to the test)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    full: list[dict[str, torch.Tensor]] = field(default_factory=list)  # full_tensor()
    local_shapes: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    placements: list[dict[str, str]] = field(default_factory=list)
    state_dict: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grad_is_dtensor: bool = True
    optimizer_state_is_dtensor: bool = True  # AdamW's exp_avg / exp_avg_sq
    # per step, at the parameters the loss saw: the sum of the magnitudes of this rank's
    # loss gradient (tolerances.reordered_loss_atols), the largest reduced gradient element
    grad_l1s: list[float] = field(default_factory=list)
    largest_grads: list[float] = field(default_factory=list)
    failed_passes: int = 0  # Script.fail_in's passes that raised


@dataclass(frozen=True)
class Script:
    """How the client script trains: AdamW's settings, and microbatches per step (all but
    the last without gradient sync, through ``set_requires_gradient_sync``)."""

    adamw: tuple[tuple[str, float], ...] = (("lr", LR), ("weight_decay", 0.1))
    microbatches: int = 1
    mlp_as_list: bool = False  # fully_shard([block.up, block.down]) first: a list as one unit
    # torchtitan's way: every FSDPModule's set_gradient_divide_factor(1.0) (and
    # set_force_sum_reduction_for_comms(True)): gradients summed over the ranks, not averaged.
    sum_gradients: bool = False
    # Every FSDPModule's set_gradient_divide_factor(divide_factor) (None: the mean).
    divide_factor: float | None = None
    # The blocks' calls' MixedPrecisionPolicy as (param_dtype, reduce_dtype, output_dtype,
    # cast_forward_inputs), and the root call's; None: the default policy.
    mp: tuple | None = None
    root_mp: tuple | None = None
    # The blocks' calls' offload policy and the root call's: "cpu" is
    # CPUOffloadPolicy(pin_memory=False), None OffloadPolicy() (the default).
    offload: str | None = None
    root_offload: str | None = None
    # ignored_params: the blocks' calls get block 0's LayerNorm weight (its bias sharded),
    # the root's call the gate's weight and bias (so the root's call must leave out what a
    # block's call left out, as FSDP2's does); they stay plain, unreduced parameters.
    ignored: bool = False
    # torch's FSDP2 example's explicit prefetch: the root prefetches block 0 in forward,
    # each block the next in forward and the previous in backward.
    explicit_prefetch: bool = False
    # The blocks' calls' reshard_after_forward (an int: reshard to groups of that many
    # ranks after forward); None: FSDP2's default.
    block_reshard: bool | int | None = None
    # fully_shard(model.embed) as a unit of its own, before the blocks, told
    # set_unshard_in_backward(False): an embedding's backward needs only its table's shape.
    embed_unit: bool = False
    # Called as after_step(model, step) after each optimizer step (a module-level
    # function, so the script pickles to the ranks): FSDPModule calls between steps.
    after_step: Callable[[nn.Module, int], None] | None = None
    # "forward" / "backward": step FAILED_STEP first runs a pass that raises in block 0's
    # forward / backward, then recovers as FSDP2 says (reset_iter_state, zero_grad).
    fail_in: str | None = None
    # A (1, 2) gain first in the root unit: at 3 ranks FSDP2 pads its empty chunks at the
    # start of ranks 1's and 2's gradient chunks, where gloo's ring blocks overlap the
    # slices ([Note: gloo's sum order]), and the unit's 173 elements a rank make them overlap.
    lead_gain: bool = False


def mp_policies(script: Script) -> tuple[dict, dict]:
    """``fully_shard``'s keywords for the blocks' calls and for the root's."""
    calls = ((script.mp, script.offload), (script.root_mp, script.root_offload))
    keywords = []
    for fields, offload in calls:
        kw = {} if fields is None else {"mp_policy": torch_fsdp.MixedPrecisionPolicy(*fields)}
        if offload == "cpu":
            kw["offload_policy"] = torch_fsdp.CPUOffloadPolicy(pin_memory=False)
        keywords.append(kw)
    if script.block_reshard is not None:
        keywords[0]["reshard_after_forward"] = script.block_reshard
    return tuple(keywords)


def run_script(
    shard: Callable[..., nn.Module], rank: int, world_size: int, script: Script = Script()
) -> Record:
    """The FSDP2 client script, with ``shard`` as its ``fully_shard``."""
    torch.manual_seed(0)
    model = TinyModel(script.lead_gain)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    block_kw, root_kw = mp_policies(script)
    if script.ignored:
        block_kw = {**block_kw, "ignored_params": {model.blocks[0].ln.weight}}
        root_kw = {**root_kw, "ignored_params": {model.gate.weight, model.gate.bias}}
    if script.embed_unit:
        shard(model.embed, mesh=mesh, **block_kw)
        model.embed.set_unshard_in_backward(False)
    for block in model.blocks:
        if script.mlp_as_list:
            shard([block.up, block.down], mesh=mesh, **block_kw)
        shard(block, mesh=mesh, **block_kw)
    shard(model, mesh=mesh, **root_kw)
    if script.explicit_prefetch:
        _set_explicit_prefetch(model)
    for module in model.modules():
        if not isinstance(module, (torch_fsdp.FSDPModule, shardwrap.FSDPModule)):
            continue
        if script.sum_gradients:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        if script.divide_factor is not None:
            module.set_gradient_divide_factor(script.divide_factor)
    optim = torch.optim.AdamW(model.parameters(), **dict(script.adamw))
    record = Record()
    for step in range(NUM_STEPS):
        if script.fail_in is not None and step == FAILED_STEP:
            record.failed_passes += _fail_once(model, optim, script.fail_in, batch(step, rank))
        for micro in range(script.microbatches):
            model.set_requires_gradient_sync(micro == script.microbatches - 1)
            idx, target = batch(10 * step + micro, rank)
            loss = F.cross_entropy(model(idx).reshape(-1, OUT), target.reshape(-1))
            loss.backward()
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]  # not ignored
        record.grad_is_dtensor &= all(isinstance(p.grad, DTensor) for p in sharded)
        _read_grads(model, sharded, idx, target, record)
        norm = torch.nn.utils.clip_grad_norm_(sharded, CLIP_NORM)
        record.grad_norms.append(_plain(norm))
        optim.step()
        if script.after_step is not None:
            script.after_step(model, step)
        record.optimizer_state_is_dtensor &= all(
            isinstance(state[key], DTensor)
            for param, state in optim.state.items()
            if isinstance(param, DTensor)  # not ignored
            for key in ("exp_avg", "exp_avg_sq")
        )
        optim.zero_grad()
        record.losses.append(float(loss.detach()))
        _read(model, record)
    return record


class InjectedFailure(RuntimeError):
    """What Script.fail_in's pass raises."""


def _fail_once(model: nn.Module, optim, where: str, data) -> bool:
    """A pass on ``data`` whose block 0 raises in its forward (``where="forward"``) or in
    its backward, after block 1's; then FSDP2's recovery: ``reset_iter_state()`` on the
    root, and ``zero_grad()`` (the failed step's gradients are lost). Whether it raised."""
    raised = False

    def raise_(*_: object) -> None:
        raise InjectedFailure(where)

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if where == "forward":
            raise_()
        output.register_hook(raise_)

    handle = model.blocks[0].register_forward_hook(hook)
    idx, target = data
    try:
        F.cross_entropy(model(idx).reshape(-1, OUT), target.reshape(-1)).backward()
    except InjectedFailure:
        raised = True
    finally:
        handle.remove()
    model.reset_iter_state()
    optim.zero_grad()
    return raised


def _read_grads(model: nn.Module, sharded: list, idx, target, record: Record) -> None:
    """This rank's loss gradient's L1 sum, on an unsharded copy at the full parameters, and
    the largest element of the ``sharded`` parameters' reduced gradients (before clipping)."""
    full = {n: _plain(p.detach()).float() for n, p in model.named_parameters()}
    largest = max(float(_plain(p.grad).abs().max()) for p in sharded)
    plain = TinyModel(lead_gain="gain" in full)
    plain.load_state_dict(full)
    loss = F.cross_entropy(plain(idx).reshape(-1, OUT), target.reshape(-1))
    grads = torch.autograd.grad(loss, list(plain.parameters()))
    record.grad_l1s.append(sum(float(g.abs().sum()) for g in grads))
    record.largest_grads.append(largest)


def _set_explicit_prefetch(model: TinyModel) -> None:
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:1])
    for index, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 2])
        block.set_modules_to_backward_prefetch(blocks[max(index - 1, 0) : index])


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()


def _read(model: nn.Module, record: Record) -> None:
    params = dict(model.named_parameters())
    record.full.append({n: _plain(p.detach()) for n, p in params.items()})
    record.local_shapes.append({n: tuple(_local(p).shape) for n, p in params.items()})
    record.placements.append({n: _placement(p) for n, p in params.items()})
    record.state_dict.append({k: _plain(v) for k, v in model.state_dict().items()})


def train_record(model: nn.Module, rank: int) -> Record:
    """:data:`NUM_STEPS` AdamW steps on :func:`batch`'s data, the DTensor parameters'
    gradients clipped to :data:`CLIP_NORM`: each step's loss, norm and views."""
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    record = Record()
    for step in range(NUM_STEPS):
        idx, target = batch(step, rank)
        loss = F.cross_entropy(model(idx).reshape(-1, OUT), target.reshape(-1))
        loss.backward()
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
        record.grad_norms.append(_plain(torch.nn.utils.clip_grad_norm_(sharded, CLIP_NORM)))
        optim.step()
        optim.zero_grad()
        record.losses.append(float(loss.detach()))
        _read(model, record)
    return record


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _placement(param: torch.Tensor) -> str:
    """A DTensor's placements and mesh dims; an ignored parameter's class and device."""
    if isinstance(param, DTensor):
        return f"{param.placements} {param.device_mesh.mesh_dim_names}"
    return f"plain {type(param).__name__} on {param.device}"


def sharded_tiny_model(world_size: int) -> TinyModel:
    """:func:`sharded_tiny` through shardwrap's ``fully_shard`` (FSDP2's defaults)."""
    return sharded_tiny("shardwrap", world_size)


def torch_run(rank: int, world_size: int, script: Script = Script()) -> Record:
    return run_script(torch_fsdp.fully_shard, rank, world_size, script)


def undivided_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """The negative control: shardwrap's ``fully_shard`` whose gradients are not divided
    by the world size (each reduced piece multiplied back). ``module`` may be a list."""
    shardwrap.fully_shard(module, **kwargs)
    handle = state_of(module[0] if isinstance(module, list) else module).unit.handle
    if handle is None:  # no parameters of its own
        return module
    grads = handle.grads
    view, world = grads.shard_grad_view, dist.get_world_size()
    grads.shard_grad_view = lambda index, piece: view(index, piece * world)
    return module


def fp32_gather_fully_shard(module: nn.Module, *, mp_policy=None, **kwargs) -> nn.Module:
    """The negative control of mixed precision: shardwrap's ``fully_shard`` with the
    policy's ``param_dtype`` ignored (gathered and computed in fp32), its reduce dtype kept."""
    if mp_policy is not None:
        reduce_dtype = mp_policy.reduce_dtype or mp_policy.param_dtype
        mp_policy = torch_fsdp.MixedPrecisionPolicy(
            None, reduce_dtype, mp_policy.output_dtype, mp_policy.cast_forward_inputs
        )
        kwargs["mp_policy"] = mp_policy
    return shardwrap.fully_shard(module, **kwargs)


def managing_ignored_fully_shard(module: nn.Module, *, ignored_params=None, **kwargs):
    """The negative control of ignored_params: shardwrap's ``fully_shard`` dropping them
    (so they are sharded, reduced and DTensors like the rest)."""
    return shardwrap.fully_shard(module, **kwargs)


def one_division_fully_shard(module: nn.Module, **kwargs) -> nn.Module:
    """The negative control of float16 reductions: shardwrap's ``fully_shard`` dividing a
    float16 sum once, after the cast (as the FSDP1 door does), not around the sum."""
    shardwrap.fully_shard(module, **kwargs)
    handle = state_of(module[0] if isinstance(module, list) else module).unit.handle
    if handle is not None:
        handle.grads.divides_around_reduction = False
    return module


CONTROLS = {
    "one_division": one_division_fully_shard,
    "undivided": undivided_fully_shard,
    "fp32_gather": fp32_gather_fully_shard,
    "ignored_managed": managing_ignored_fully_shard,
}


def both(
    rank: int, world_size: int, script: Script = Script(), control: str | None = None
) -> tuple[Record, Record]:
    """torch's run, then shardwrap's (or the negative control named ``control``'s;
    ``"rank_order"``: gloo reduce-scatters summed in rank order)."""
    reference = torch_run(rank, world_size, script)
    dist.barrier()
    if control == "rank_order":  # the sum order before [Note: gloo's sum order]
        with mock.patch.object(sum_order, "ring_order", lambda _, size: tuple(range(size))):
            return reference, run_script(shardwrap.fully_shard, rank, world_size, script)
    shard = shardwrap.fully_shard if control is None else CONTROLS[control]
    return reference, run_script(shard, rank, world_size, script)


@dataclass(frozen=True)
class Tolerances:
    """``assert_close`` keywords for what a reordered reduction may change (None: exact).
    Losses take ``tolerances.reordered_loss_atols`` of ``params`` (the drift of the steps
    before each)."""

    values: dict[str, float]  # gradient norms
    params: Callable[[int], dict[str, float]]  # parameters after that many steps
    grad_scale: float  # the bounds' gradient scale: the reference's gradients stay under it


def clipped_param_tol(num_steps: int) -> dict[str, float]:
    """The model's parameters after ``num_steps`` steps of the reorder-safe AdamW on
    gradients (under ``tolerances.GRAD_SCALE``: :func:`differences` checks it) clipped
    to ``CLIP_NORM``. Seen at 3 ranks (tests/dist/test_fsdp2_door.py): gradients up to
    0.075; parameters 6e-8 apart after 4 steps (bound 1.4e-3), losses up to 1.2e-7
    (bounds 1.2e-5 at step 0 to 8.5e-3 at step 3)."""
    numel = sum(p.numel() for p in TinyModel().parameters())
    scale = tolerances.GRAD_SCALE * tolerances.clipped_grad_multiple(numel, CLIP_NORM)
    atol = tolerances.reordered_param_atol(num_steps, grad_scale=scale)
    return {"rtol": tolerances.step_rounding_rtol(num_steps), "atol": atol}


# Gradient norms: their own rounding (those after the first step also carry the drift
# through the loss's curvature, which tests/tolerances.py does not bound); losses: the drift
# before them (differences).
REORDERED = Tolerances(tolerances.REORDERED_VALUE_TOL, clipped_param_tol, tolerances.GRAD_SCALE)


def _same(a: torch.Tensor, b: torch.Tensor, tol: dict[str, float] | None) -> bool:
    if tol is None:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol["rtol"], atol=tol["atol"])


def differences(reference: Record, ours: Record, tol: Tolerances | None = None) -> list[str]:
    """Everything the two runs show differently, one line each: bit for bit, or within
    ``tol`` for the values a reduction's order changes (shapes, placements, keys: exact)."""
    found = []
    value_tol = None if tol is None else tol.values
    loss_atols = [0.0] * NUM_STEPS
    if tol is not None:
        if max(reference.largest_grads) >= tol.grad_scale:
            found.append(f"gradients up to {max(reference.largest_grads)}: over the bound's scale")
        largest = max(float(v.abs().max()) for v in reference.full[-1].values())
        loss_atols = tolerances.reordered_loss_atols(
            reference.losses, reference.grad_l1s, largest, tol.params
        )
    for step in range(NUM_STEPS):
        param_tol = None if tol is None else tol.params(step + 1)
        a, b = reference.losses[step], ours.losses[step]
        if not (a == b if tol is None else abs(a - b) <= loss_atols[step]):
            found.append(f"step {step}: loss {a!r} != {b!r}")
        a, b = reference.grad_norms[step], ours.grad_norms[step]
        if not _same(a, b, value_tol):
            found.append(f"step {step}: grad norm {a.item()!r} != {b.item()!r}")
        for view in ("full", "local_shapes", "placements", "state_dict"):
            a, b = getattr(reference, view)[step], getattr(ours, view)[step]
            if a.keys() != b.keys():
                found.append(f"step {step}: {view} keys {sorted(a)} != {sorted(b)}")
                continue
            for name in a:
                tensors = view in ("full", "state_dict")
                if not (_same(a[name], b[name], param_tol) if tensors else a[name] == b[name]):
                    found.append(f"step {step}: {view}[{name!r}] differs")
    if not (reference.optimizer_state_is_dtensor and ours.optimizer_state_is_dtensor):
        found.append("optimizer state: not DTensors")
    if not (reference.grad_is_dtensor and ours.grad_is_dtensor):
        found.append(
            f"DTensor gradients: torch {reference.grad_is_dtensor}, ours {ours.grad_is_dtensor}"
        )
    return found


def compare(
    rank: int, world_size: int, script: Script, tol: Tolerances | None, control: str | None
) -> list[str]:
    """Run both and return their differences (compared on the rank: records stay here)."""
    reference, ours = both(rank, world_size, script, control)
    return differences(reference, ours, tol)
