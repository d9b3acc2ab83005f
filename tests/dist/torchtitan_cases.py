"""torchtitan's llama3 trained through torchtitan's own FSDP2 code: torch's ``fully_shard``
and, after ``shardwrap.install()``, shardwrap's.

Worker-side helpers for ``test_torchtitan_fsdp2.py``. The steps are those of torchtitan's
``Trainer.__init__`` for a model without pipeline parallelism: build the model on the meta
device, ``parallelize_llama`` with a ``ParallelDims`` of ``dp_shard=2`` (its
``apply_fsdp_to_decoder``: ``fully_shard`` on the embedding, on ``[norm, lm_head]`` as one
unit, on each block, on the root, then ``set_gradient_divide_factor(1.0)`` on every module
that is an instance of ``torch.distributed._composable.fsdp.FSDPModule``), ``to_empty`` and
``init_weights`` under ``torch.no_grad()``, then AdamW steps on a loss summed over tokens
and divided by the global token count (torchtitan's: gradients are summed across ranks,
not averaged).

[Note: torchtitan binds fully_shard at import]
``torchtitan.distributed.fsdp`` does ``from torch.distributed.fsdp import fully_shard`` and
``from torch.distributed._composable.fsdp import FSDPModule`` when it is imported, so it
builds whatever those names held then: ``shardwrap.install()`` must run before torchtitan
is imported (install.py's module doc says so). Both runs happen in the same pooled ranks,
so each starts by forgetting every ``torchtitan`` module and importing it again, as a
fresh process would (after ``install()`` for shardwrap's run), and forgets it again at the
end, so no later test finds a torchtitan bound to the other door.

torchtitan needs two accommodations on a CPU machine, neither about FSDP: its
``tools.utils.device_type`` is ``"cuda"`` when no accelerator is found, so the mesh it
builds is on ``"cpu"`` here (gloo); and its language-model attention backends are
FlexAttention (compiled) or varlen (CUDA), so the tiny model's blocks use torchtitan's own
``ScaledDotProductAttention`` (causal), as its Flux model does.
"""

from __future__ import annotations

import importlib
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwrap
from shardwrap.fsdp2.state import state_of

STEPS = 3
BATCH, SEQ_LEN = 2, 16
DIM, NUM_HEADS, NUM_LAYERS, VOCAB = 64, 4, 2, 256
SEED = 0


def _forget_torchtitan() -> None:
    """Drop every torchtitan module, so the next import runs its module code again."""
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
        del sys.modules[name]


LINEAR_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
NORM_INIT = {"weight": nn.init.ones_}


def _block_config(layer_id: int):
    """One llama3 block as torchtitan's flavors configure it: fused-QKV grouped-query
    attention with SDPA and complex RoPE, its FFN, depth-scaled output initialisers."""
    from torchtitan.models.common import (
        ComplexRoPE,
        RMSNorm,
        ScaledDotProductAttention,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.llama3 import Llama3TransformerBlock

    rope = ComplexRoPE.Config(
        dim=DIM // NUM_HEADS, max_seq_len=SEQ_LEN, theta=500000, scaling="llama"
    )
    depth_init = {
        "weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)),
        "bias": nn.init.zeros_,
    }
    return Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=NORM_INIT),
        ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=NORM_INIT),
        attention=make_gqa_config(
            dim=DIM,
            n_heads=NUM_HEADS,
            wqkv_param_init=LINEAR_INIT,
            wo_param_init=depth_init,
            inner_attention=ScaledDotProductAttention.Config(),
            fuse_qkv=True,
            rope=rope,
        ),
        feed_forward=make_ffn_config(
            dim=DIM,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
            w1_param_init=LINEAR_INIT,
            w2w3_param_init=depth_init,
        ),
    )


def _tiny_llama3_config(tied: bool):
    """A llama3 config the way torchtitan's flavors build one, smaller: torchtitan's config
    helpers and initialisers, SDPA inner attention. ``tied``: the embedding shares the
    output projection's weight and is not initialised itself (its 1B and 3B flavors), else
    each has its own (``debugmodel``, 8B and up)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.param_init import skip_param_init
    from torchtitan.models.llama3 import Llama3Model

    head_std = DIM**-0.5
    head_init = partial(nn.init.trunc_normal_, std=head_std, a=-3 * head_std, b=3 * head_std)
    embedding_init = skip_param_init if tied else partial(nn.init.normal_, std=1.0)
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": embedding_init}
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM,
            out_features=VOCAB,
            param_init={"weight": head_init, "bias": nn.init.zeros_},
        ),
        layers=[_block_config(layer_id) for layer_id in range(NUM_LAYERS)],
    )


def build(world_size: int, spmd_backend: str, tied: bool):
    """torchtitan's steps up to a sharded, initialised model (see the module doc)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallel_dims_module = importlib.import_module("torchtitan.distributed.parallel_dims")
    parallel_dims_module.device_type = "cpu"  # torchtitan's guess is "cuda" (module doc)
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world_size, spmd_backend=spmd_backend
    )
    training = TrainingConfig(mixed_precision_param="float32")
    config = _tiny_llama3_config(tied)
    # What Llama3Model.Config.update_from_config does for a model without TP or CP (it
    # imports torchtitan.trainer, whose data loading needs torchdata and datasets).
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def sum_on_gloo(model: nn.Module) -> None:
    """torch's FSDP2 reduce-scatters gradients whose divide factor is 1.0 with
    ``ReduceOp.PREMUL_SUM(1.0)``, which gloo refuses (NCCL has it); forced to a plain
    ``SUM`` (and a division by 1.0, which it skips) it computes the same sums. For torch's
    run only: shardwrap's runs torchtitan's code as it is."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def batches(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's tokens and labels for ``rank``: its own, the same in both runs."""
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ_LEN + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def train(model: nn.Module, rank: int, world_size: int) -> tuple[list[float], list[float]]:
    """torchtitan's step: the loss summed over tokens over the global token count,
    backward, its ``clip_grad_norm_`` (``get_total_norm`` on the DTensor gradients, to
    ``TrainingConfig.max_norm``), AdamW. Each step's loss and gradient norm."""
    from torchtitan.config import TrainingConfig
    from torchtitan.distributed.utils import clip_grad_norm_

    max_norm = TrainingConfig().max_norm
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1)
    global_tokens = BATCH * SEQ_LEN * world_size
    losses, grad_norms = [], []
    for tokens, labels in batches(rank, world_size):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss = loss / global_tokens
        loss.backward()
        grad_norm = clip_grad_norm_(list(model.parameters()), max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        grad_norms.append(grad_norm.item())
    return losses, grad_norms


def record(model: nn.Module, losses: list[float], grad_norms: list[float]) -> dict:
    fsdp_types = sorted({type(m).__module__ for m in model.modules() if "FSDP" in type(m).__name__})
    ours = [m for m in model.modules() if isinstance(m, shardwrap.FSDPModule)]
    ledger = state_of(model).root.comm_ledger.records if state_of(model) is not None else []
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "fsdp_modules": fsdp_types,
        "num_shardwrap_modules": len(ours),
        "collectives": sorted({(r.kind, r.purpose) for r in ledger}),
    }


# How each run reaches torchtitan: "torch" (torch's FSDP2), "shardwrap" (install()), or the
# negative control "shardwrap_without_composable": install() with torch's FSDPModule left
# in torch.distributed._composable.fsdp, where torchtitan's isinstance check reads it.
DOORS = ("torch", "shardwrap", "shardwrap_without_composable")


def _enter(door: str) -> None:
    if door == "torch":
        return
    shardwrap.install()
    if door == "shardwrap_without_composable":
        composable = importlib.import_module("torch.distributed._composable.fsdp")
        composable.FSDPModule = importlib.import_module(
            "torch.distributed.fsdp._fully_shard"
        ).FSDPModule


def run(rank: int, world_size: int, door: str, spmd_backend: str, tied: bool) -> dict:
    """One training run on ``door`` (one of :data:`DOORS`) through torchtitan's code, on a
    torchtitan imported afresh ([Note: torchtitan binds fully_shard at import])."""
    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, got {door!r}")
    _forget_torchtitan()
    _enter(door)
    try:
        model = build(world_size, spmd_backend, tied)
        if door == "torch":
            sum_on_gloo(model)
        losses, grad_norms = train(model, rank, world_size)
        dist.barrier()
        return record(model, losses, grad_norms)
    finally:
        if door != "torch":
            shardwrap.uninstall()
        _forget_torchtitan()


def runs(rank: int, world_size: int, doors: tuple[str, ...], spmd_backend: str, tied: bool) -> dict:
    return {door: run(rank, world_size, door, spmd_backend, tied) for door in doors}


def refusals(rank: int, world_size: int, spmd_backend: str) -> dict[str, str]:
    """What torch's ``fully_shard`` and shardwrap's door say to torchtitan's
    ``parallelize_llama`` on ``spmd_backend``, by door: the exception's type and message
    (an empty string if it built the model)."""
    found = {}
    for door in ("torch", "shardwrap"):
        _forget_torchtitan()
        _enter(door)
        try:
            build(world_size, spmd_backend, tied=False)
            found[door] = ""
        except Exception as error:  # noqa: BLE001 - what it raised is the result
            found[door] = f"{type(error).__name__}: {error}"
        finally:
            if door != "torch":
                shardwrap.uninstall()
            _forget_torchtitan()
    return found
