"""Workers for 3-D parallelism on a Hugging Face model (test_threed.py): a tiny Llama.

Each pipeline stage is the whole ``LlamaForCausalLM`` with the other stage's parts taken
out, so that its parameter names (and so the checkpoint's) are the Hugging Face model's:
stage 0 keeps the embeddings and decoder layers 0-1 (layers 2-3 become :class:`Skip`, the
final norm and the head ``Identity``) and returns the hidden states; stage 1 keeps layers
2-3, the final norm and the head (the embeddings ``Identity``, layers 0-1 :class:`Skip`)
and takes the hidden states as ``inputs_embeds``. Tensor parallelism splits every
attention and MLP projection (q/k/v, gate/up column-wise; o/down row-wise) over
``mesh["tp"]``; ZeRO shards each stage over ``mesh["dp"]``; torch's ``Schedule1F1B``
drives the stages through ``ShardedPipelineStage`` over ``mesh["pp"]``. The reference is
the plain ``LlamaForCausalLM`` trained in one process on the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import shardwrap
from shardwrap.features.pipeline_stage import ShardedPipelineStage
from shardwrap.policies import ModuleWrapPolicy
from tests.dist.pipeline_cases import dp_mean_loss, run_schedule
from tests.dist.tp_cases import model_state_bytes
from tests.tolerances import REORDER_SAFE_ADAMW

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 4, 4, 8
MICRO_BATCH, NUM_MICROBATCHES, NUM_STEPS = 2, 2, 3
SPLIT = LAYERS // 2  # stage 0: layers [0, SPLIT); stage 1: [SPLIT, LAYERS)
COLWISE = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


class Skip(nn.Module):
    """Stands in for a decoder layer another stage holds: hidden states pass unchanged."""

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        return hidden_states


class LlamaStage(transformers.LlamaForCausalLM):
    """``LlamaForCausalLM`` whose forward maps a tensor to a tensor, for one stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.dtype == torch.long:  # token ids: the first stage
            return super().forward(input_ids=x).logits
        return super().forward(inputs_embeds=x).logits


def whole_model(seed: int = 4321, cls: type = transformers.LlamaForCausalLM) -> nn.Module:
    torch.manual_seed(seed)
    return cls(config()).train()


def stage_module(pp_rank: int, seed: int = 4321) -> LlamaStage:
    """Stage ``pp_rank`` of the model, under the whole model's parameter names."""
    model = whole_model(seed, LlamaStage)
    layers = model.model.layers
    if pp_rank == 0:
        for i in range(SPLIT, LAYERS):
            layers[i] = Skip()
        model.model.norm, model.lm_head = nn.Identity(), nn.Identity()
    else:
        for i in range(SPLIT):
            layers[i] = Skip()
        model.model.embed_tokens = nn.Identity()
    return model


def stage_layers(pp_rank: int) -> range:
    return range(0, SPLIT) if pp_rank == 0 else range(SPLIT, LAYERS)


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (dp * NUM_MICROBATCHES * MICRO_BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference_run(dp: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """The plain Hugging Face model trained in one process: losses, final parameters,
    each step's sum of gradient magnitudes (for ``tolerances.reordered_loss_atols``)."""
    model = whole_model()
    optim = torch.optim.AdamW(model.parameters(), **REORDER_SAFE_ADAMW)
    losses, grad_l1s = [], []
    for step in range(NUM_STEPS):
        x, y = global_batch(step, dp)
        loss = loss_fn(model(input_ids=x).logits, y)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_l1s.append(sum(float(g.abs().sum()) for g in grads))
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grad_l1s


def _stage(mesh, pp: int, strategy: str):
    pp_rank = mesh["pp"].get_local_rank()
    module = stage_module(pp_rank)
    if "tp" in mesh.mesh_dim_names:
        plan = {
            f"model.layers.{i}.{n}": ColwiseParallel()
            for i in stage_layers(pp_rank)
            for n in COLWISE
        }
        plan.update(
            {
                f"model.layers.{i}.{n}": RowwiseParallel()
                for i in stage_layers(pp_rank)
                for n in ROWWISE
            }
        )
        parallelize_module(module, mesh["tp"], plan)
    sharded = shardwrap.ShardedModule(
        module,
        device_mesh=mesh["dp"],
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
    )
    hidden = torch.zeros(MICRO_BATCH, SEQ, HIDDEN, requires_grad=True)
    static = {
        "input_args": (
            torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long) if pp_rank == 0 else hidden,
        ),
        "output_args": (
            hidden if pp_rank == 0 else torch.zeros(MICRO_BATCH, SEQ, VOCAB, requires_grad=True),
        ),
    }
    stage = ShardedPipelineStage(
        sharded, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group(), **static
    )
    return stage, sharded


def train_worker(rank: int, world_size: int, shape: dict, save_to: str) -> dict:
    """Train on the mesh ``shape`` (``{"pp": .., "dp": .., "tp": ..}``, TP optional), ZeRO-3;
    save a checkpoint to ``save_to``; the losses (last stage) and the stage's full model."""
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    pp, dp = shape["pp"], shape["dp"]
    stage, module = _stage(mesh, pp, "FULL_SHARD")
    dp_rank = mesh["dp"].get_local_rank()
    optim = torch.optim.AdamW(module.parameters(), **REORDER_SAFE_ADAMW)
    sched = Schedule1F1B(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn)
    rows = NUM_MICROBATCHES * MICRO_BATCH
    losses = []
    for step in range(NUM_STEPS):
        x, y = global_batch(step, dp)
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        step_losses = run_schedule(sched, x, y, is_first=stage.is_first, is_last=stage.is_last)
        optim.step()
        state_bytes = model_state_bytes(optim)  # with the step's gradients still held
        optim.zero_grad()
        if stage.is_last:
            losses.append(dp_mean_loss(step_losses, mesh["dp"].get_group(), dp))
    shardwrap.save_checkpoint(save_to, module, optim, extra={"step": NUM_STEPS})
    units = sum(1 for u in module.units if u.handle is not None and u.handle.has_trainable_params)
    return {
        "losses": losses,
        "model": dict(module.state_dict()),
        "is_last": stage.is_last,
        "pp_rank": mesh["pp"].get_local_rank(),
        "model_state_bytes": state_bytes,
        "units": units,
    }


def local_numel(pp_rank: int, tp: int) -> int:
    """Parameter elements one TP rank of stage ``pp_rank`` holds: the projections / ``tp``,
    the rest (norms, embeddings, head) whole."""
    split = COLWISE + ROWWISE
    total = 0
    for name, param in stage_module(pp_rank).named_parameters():
        total += (
            param.numel() // tp
            if name.endswith(tuple(f"{n}.weight" for n in split))
            else param.numel()
        )
    return total
