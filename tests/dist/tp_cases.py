"""Workers for ZeRO inside tensor parallelism (tests/dist/test_tensor_parallel.py).

The model is a small pre-norm transformer whose attention and MLP are split by torch's
``parallelize_module`` (q/k/v and fc column-wise, proj and out row-wise, so each TP rank
holds half of the heads and half of the hidden units); embedding, norms and head stay
plain, replicated tensors. Four ranks form a (dp=2, tp=2) mesh: the two TP ranks of one
DP index see the same batch, the two DP indices different halves of the global batch.
The reference is the same model, unparallelized, trained in one process on the global
batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import shardwrap
from shardwrap import ShardedModule
from shardwrap.policies import ModuleWrapPolicy
from tests.tolerances import REORDER_SAFE_ADAMW

DP, TP = 2, 2
VOCAB, DIM, HEADS, SEQ, BATCH = 16, 8, 2, 4, 2  # BATCH: per data-parallel rank
NUM_STEPS = 5


class TPBlock(nn.Module):
    """Attention (separate q/k/v so column-wise TP splits heads) and an MLP."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        # The whole sequence (x holds a part of it under sequence parallelism), and -1
        # heads: all of them unparallelized, this rank's share under TP.
        q, k, v = (z(h) for z in (self.q, self.k, self.v))
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TPNet(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(depth))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_reference() -> TPNet:
    torch.manual_seed(4321)
    return TPNet()


def tp_plan() -> dict:
    plan = {}
    for i in range(2):
        for name in ("q", "k", "v", "fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("proj", "out"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def sequence_parallel_plan() -> dict:
    """Megatron-style sequence parallelism: norms and residuals hold a part of the sequence
    (their weights' gradients come ``Partial``), the embedding and head split the vocab."""
    seq = Shard(1)
    plan = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    for i in range(2):
        for name in ("ln1", "ln2"):
            plan[f"blocks.{i}.{name}"] = SequenceParallel()
        for name in ("q", "k", "v", "fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel(input_layouts=seq)
        for name in ("proj", "out"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel(output_layouts=seq)
    return plan


def make_mesh(dp: int = DP, tp: int = TP):
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def make_mesh_3d():
    """A (pp, dp, tp) mesh with one stage: the user slices ``mesh["dp"]`` out of 3 dims."""
    return init_device_mesh("cpu", (1, DP, TP), mesh_dim_names=("pp", "dp", "tp"))


def parallelized(model: nn.Module, mesh, plan: dict | None = None) -> nn.Module:
    return parallelize_module(copy.deepcopy(model), mesh["tp"], plan or tp_plan())


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(DP * BATCH, SEQ)`` tokens and targets; DP rank r takes rows ``[r*BATCH, ...)``."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (DP * BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def local_rows(batch, dp_rank: int, dp: int = DP):
    rows = batch[0].shape[0] // dp
    return tuple(t[dp_rank * rows : (dp_rank + 1) * rows] for t in batch)


def reference_run(num_steps: int = NUM_STEPS, max_norm: float | None = None):
    """Losses, clipping norms and final parameters of single-process training, and each
    step's sum of gradient magnitudes before clipping (``tolerances.reordered_loss_atols``)."""
    model = build_reference()
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    losses, norms, grad_l1s = [], [], []
    for step in range(num_steps):
        loss = loss_of(model, *global_batch(step))
        loss.backward()
        grad_l1s.append(sum(float(p.grad.abs().sum()) for p in model.parameters()))
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return losses, norms, state, grad_l1s


def wrap(model: nn.Module, mesh, strategy: str = "FULL_SHARD", **kwargs) -> ShardedModule:
    return ShardedModule(
        model,
        device_mesh=mesh["dp"],
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({TPBlock}),
        **kwargs,
    )


def train_tp(
    rank: int,
    world_size: int,
    strategy: str,
    max_norm,
    num_steps: int = NUM_STEPS,
    sequence_parallel: bool = False,
):
    """TP2 x DP2 training: losses, norms, full state dict, and what the units showed."""
    mesh = make_mesh()
    plan = sequence_parallel_plan() if sequence_parallel else None
    sharded = wrap(parallelized(build_reference(), mesh, plan), mesh, strategy)
    optim = torch.optim.AdamW(sharded.parameters(), **REORDER_SAFE_ADAMW)
    dp_rank = mesh["dp"].get_local_rank()
    losses, norms, shown = [], [], {}

    def note_shown(module, args):
        shown[type(module.q.weight).__name__] = tuple(module.q.weight.shape)

    handle = sharded.module.blocks[0].register_forward_pre_hook(note_shown, prepend=False)
    sharded.comm_ledger.reset()
    for step in range(num_steps):
        loss = loss_of(sharded, *local_rows(global_batch(step), dp_rank))
        loss.backward()
        if max_norm is not None:
            norms.append(sharded.clip_grad_norm_(max_norm))
        optim.step()
        state_bytes = model_state_bytes(optim)
        optim.zero_grad()
        losses.append(_mean_over_dp(loss.detach(), mesh))
    handle.remove()
    grad_groups = {r.group_size for r in sharded.comm_ledger.records if r.purpose == "grads"}
    return {
        "losses": losses,
        "norms": norms,
        "state": sharded.state_dict(),
        "shown": shown,
        "grad_group_sizes": grad_groups,
        "tp_grad_records": sum(1 for r in sharded.comm_ledger.records if r.purpose == "tp_grads"),
        "model_state_bytes": state_bytes,
        "num_units": len(sharded.units),
    }


def model_state_bytes(optim) -> int:
    """Bytes of what the optimizer holds: parameter shards, their gradients, its state."""
    total = 0
    for group in optim.param_groups:
        for param in group["params"]:
            tensors = [param, param.grad, *optim.state[param].values()]
            total += sum(
                t.numel() * t.element_size()
                for t in tensors
                if isinstance(t, torch.Tensor) and t.dim() > 0
            )
    return total


def local_numel(sequence_parallel: bool = False) -> int:
    """Parameter elements one TP rank holds: TP-split ones / TP, replicated ones whole."""
    plan = sequence_parallel_plan() if sequence_parallel else tp_plan()
    model = build_reference()
    total = 0
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        style = plan.get(module_name)
        split = isinstance(style, ColwiseParallel) or (
            isinstance(style, RowwiseParallel) and attr == "weight"
        )
        total += param.numel() // TP if split else param.numel()
    return total


def _mean_over_dp(loss: torch.Tensor, mesh) -> torch.Tensor:
    """The global batch's loss: the mean of the DP ranks' (TP ranks agree already)."""
    total = loss.clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    return total / mesh["dp"].size()


def train_strategies(rank: int, world_size: int, strategies: tuple[str, ...], max_norm):
    return {s: train_tp(rank, world_size, s, max_norm) for s in strategies}


# ------------------------------------------------------------------ checkpoints
def _trained(model: nn.Module, optim, dp_rank: int, dp: int, steps: int = 2) -> None:
    for step in range(steps):
        loss_of(model, *local_rows(global_batch(step), dp_rank, dp)).backward()
        optim.step()
        optim.zero_grad()


def _states(model: ShardedModule, optim) -> dict:
    return {"model": model.state_dict(), "optim": ShardedModule.optim_state_dict(model, optim)}


def save_tp(rank: int, world_size: int, path: str) -> dict:
    """Train 2 steps at TP2 x DP2, save; the full states it had."""
    mesh = make_mesh()
    model = wrap(parallelized(build_reference(), mesh), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    _trained(model, optim, mesh["dp"].get_local_rank(), DP)
    shardwrap.save_checkpoint(path, model, optim)
    return _states(model, optim)


def save_dp(rank: int, world_size: int, path: str) -> dict:
    """Train 2 steps at plain DP (world_size ranks), save; the full states it had."""
    model = ShardedModule(build_reference(), auto_wrap_policy=ModuleWrapPolicy({TPBlock}))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    _trained(model, optim, rank, world_size)
    shardwrap.save_checkpoint(path, model, optim)
    return _states(model, optim)


def _fresh() -> TPNet:
    torch.manual_seed(99)  # other values than the saved ones: the load must change them
    return TPNet()


def load_dp(rank: int, world_size: int, path: str) -> dict:
    model = ShardedModule(_fresh(), auto_wrap_policy=ModuleWrapPolicy({TPBlock}))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    shardwrap.load_checkpoint(path, model, optim)
    return _states(model, optim)


def load_tp(rank: int, world_size: int, path: str, tp: int = TP) -> dict:
    """Load at TP ``tp`` x DP ``4 / tp``; then hand the full state dicts to a fresh model
    through ``load_state_dict`` / ``optim_state_dict_to_load`` (``"reloaded"``)."""
    mesh = make_mesh(world_size // tp, tp)
    model = wrap(parallelized(_fresh(), mesh), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    shardwrap.load_checkpoint(path, model, optim)
    states = _states(model, optim)
    fresh = wrap(parallelized(_fresh(), mesh), mesh)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh.load_state_dict(states["model"])
    ShardedModule.optim_state_dict_to_load(fresh, fresh_optim, states["optim"], load_directly=True)
    return {**states, "reloaded": _states(fresh, fresh_optim)}


def pretrained_tp(rank: int, world_size: int, folder: str) -> dict[str, torch.Tensor]:
    """Load a Hugging Face folder (one model.safetensors) into a TP2 x DP2 model."""
    mesh = make_mesh()
    model = wrap(parallelized(_fresh(), mesh), mesh)
    shardwrap.load_pretrained(model, folder)
    return model.state_dict()


# ------------------------------------------------------- summon, no_sync, precision
def summon_and_no_sync(rank: int, world_size: int) -> dict:
    """Two steps of two micro-batches each, the first under ``no_sync``; then summon.
    On a 3-D mesh's ``dp`` slice."""
    mesh = make_mesh_3d()
    model = wrap(parallelized(build_reference(), mesh), mesh)
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(2):
        with model.no_sync():
            loss_of(model, *local_rows(global_batch(2 * step), dp_rank)).backward()
        loss_of(model, *local_rows(global_batch(2 * step + 1), dp_rank)).backward()
        optim.step()
        optim.zero_grad()
    summoned = {}
    with ShardedModule.summon_full_params(model, writeback=False), torch.no_grad():
        for name, param in model.named_parameters():
            summoned[name] = (
                type(param).__name__,
                tuple(param.shape),
                param.full_tensor() if isinstance(param, DTensor) else param.detach().clone(),
            )
    return {"summoned": summoned, "state": model.state_dict()}


def reference_no_sync() -> dict[str, torch.Tensor]:
    model = build_reference()
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    for step in range(2):
        for micro in (2 * step, 2 * step + 1):
            loss_of(model, *global_batch(micro)).backward()
        optim.step()
        optim.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def hybrid_state(rank: int, world_size: int, num_steps: int) -> dict:
    """HYBRID_SHARD over the (replicate, shard) slice of a (replicate, shard, tp) mesh."""
    mesh = init_device_mesh("cpu", (1, DP, TP), mesh_dim_names=("replicate", "shard", "tp"))
    model = ShardedModule(
        parallelize_module(build_reference(), mesh["tp"], tp_plan()),
        device_mesh=mesh["replicate", "shard"],
        sharding_strategy="HYBRID_SHARD",
        auto_wrap_policy=ModuleWrapPolicy({TPBlock}),
    )
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    _trained(model, optim, mesh["shard"].get_local_rank(), DP, num_steps)
    return model.state_dict()


def offload_and_checkpointing(rank: int, world_size: int, num_steps: int) -> dict:
    """Full state dicts after training with CPUOffload, and with activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    mesh = make_mesh()
    dp_rank = mesh["dp"].get_local_rank()
    offload = shardwrap.CPUOffload(offload_params=True)
    states = {}
    for case in ("cpu_offload", "activation_checkpointing"):
        kwargs = {"cpu_offload": offload} if case == "cpu_offload" else {}
        model = wrap(parallelized(build_reference(), mesh), mesh, **kwargs)
        if case == "activation_checkpointing":
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TPBlock))
        optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
        _trained(model, optim, dp_rank, DP, num_steps)
        states[case] = model.state_dict()
    return states


def refusals(rank: int, world_size: int) -> dict[str, str]:
    """What TP x DP refuses, with the messages it gives."""
    mesh = make_mesh()
    messages = {}
    try:
        wrap(parallelized(build_reference(), mesh), mesh, sync_module_states=True)
    except ValueError as exc:
        messages["sync_module_states"] = str(exc)
    model = wrap(parallelized(build_reference(), mesh), mesh)
    try:
        with ShardedModule.state_dict_type(model, "SHARDED_STATE_DICT"):
            model.state_dict()
    except ValueError as exc:
        messages["sharded_state_dict"] = str(exc)
    return messages
