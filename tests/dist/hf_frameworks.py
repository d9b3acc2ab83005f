"""accelerate and the Hugging Face Trainer driving shardwrap through ``shardwrap.install()``.

Worker-side helpers for ``test_accelerate.py``. accelerate picks its FSDP path only on
accelerators; on CPU it sets up the gloo group as ``MULTI_CPU`` (DDP), and these helpers
then select the FSDP path by hand, as a GPU machine would, so the FSDP code that runs is
accelerate's own, unchanged: ``prepare`` builds ``FullyShardedDataParallel`` from torch's
name (ours after ``install()``), ``save_state``/``load_state`` save and restore it.
"""

from __future__ import annotations

import os

import torch

import shardwrap
from tests.tolerances import ADAMW_EPS

STEPS = 3  # per phase: train, save, resume in fresh processes, train again
VOCAB, SEQ = 96, 16
SGD_LR = 0.1  # the parameter comparisons' optimizer


def set_launcher_env(rank: int, world_size: int) -> None:
    """The variables torchrun sets, which accelerate reads (the group is already up)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )


def build_model(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def layer_class(kind: str) -> str:
    return "GPT2Block" if kind == "gpt2" else "LlamaDecoderLayer"


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def make_accelerator(kind: str, *, fsdp: bool, mixed_precision: str):
    """An ``Accelerator`` on the running gloo group; FSDP1 path when ``fsdp``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffload

    # Each run in these ranks starts from accelerate's fresh state.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if not fsdp:
        return Accelerator(cpu=True, mixed_precision=mixed_precision)
    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy="FULL_SHARD",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[layer_class(kind)],
        cpu_offload=CPUOffload(offload_params=False),
        state_dict_type="FULL_STATE_DICT",
    )
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=plugin)
    # By hand, what accelerate does on a GPU machine: the FSDP path, the plugin's precision.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def train(
    rank: int,
    kind: str,
    *,
    fsdp: bool,
    mixed_precision: str,
    first_step: int,
    num_steps: int,
    load_from: str | None = None,
    save_to: str | None = None,
    sgd: bool = False,
    grad_factor: float = 1.0,
) -> dict:
    """Train ``num_steps`` steps from ``first_step`` (after ``load_state`` if given).

    ``sgd``: plain SGD (``SGD_LR``) instead of AdamW, whose step hides a gradient's scale;
    ``grad_factor``: scale the gradients before each step (a negative control's bug).
    """
    accelerator = make_accelerator(kind, fsdp=fsdp, mixed_precision=mixed_precision)
    model = accelerator.prepare(build_model(kind))
    if sgd:
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = accelerator.prepare(optimizer)
    if load_from is not None:
        accelerator.load_state(load_from)
    losses = []
    for step in range(first_step, first_step + num_steps):
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if grad_factor != 1.0:
            for param in model.parameters():
                param.grad.mul_(grad_factor)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    if save_to is not None:
        accelerator.save_state(save_to)
    units = shardwrap.FullyShardedDataParallel.fsdp_modules(model) if fsdp else []
    out = {"losses": losses, "wrapper": type(model).__name__, "num_fsdp": len(units)}
    if sgd:
        out["params"] = full_params(model, fsdp=fsdp)
    return out


def full_params(model: torch.nn.Module, *, fsdp: bool) -> dict[str, torch.Tensor]:
    """The model's full fp32 parameters on this rank, by the Hugging Face model's names."""
    if not fsdp:  # accelerate's DDP wrapper
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    with shardwrap.FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


class _TokenData(torch.utils.data.Dataset):
    """64 fixed random sequences; the Trainer's seeded sampler orders them."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(index)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids}


TRAINER_LR = 1e-3
TRAINER_MAX_GRAD_NORM = 1.0  # the Trainer's default: clipping runs through the wrapper


def trainer_run(
    *, fsdp: bool, output_dir: str, resume: str | None = None, record: dict | None = None
) -> list[float]:
    """``transformers.Trainer`` for ``2 * STEPS`` steps, a checkpoint every ``STEPS``;
    FSDP1 (``fsdp="full_shard auto_wrap"``) when ``fsdp``, else its DDP. The logged
    losses of the steps it ran (``record``: see :func:`trainer_train`)."""
    trainer, losses = trainer_train(
        fsdp_version=1 if fsdp else None, output_dir=output_dir, resume=resume, record=record
    )
    if fsdp:
        assert isinstance(trainer.model_wrapped, shardwrap.FullyShardedDataParallel)
    return losses


def trainer_train(
    *,
    fsdp_version: int | None,
    output_dir: str,
    resume: str | None = None,
    record: dict | None = None,
):
    """``transformers.Trainer`` for ``2 * STEPS`` steps, a checkpoint every ``STEPS``;
    with ``fsdp="full_shard auto_wrap"`` in that FSDP version (1: FSDP1, 2: FSDP2's
    ``fully_shard``), or its DDP for None. The trainer, and the logged losses of the steps
    it ran. Its AdamW takes ``tolerances.ADAMW_EPS``: FSDP1's run and DDP's are compared
    with a bound (the wrapped parameters are views into flat buffers, where kernels block
    their sums otherwise). ``record`` gets, per step, the sum of the gradients' magnitudes
    and their largest element (as the optimizer gets them: clipped), the logged gradient
    norms (before clipping), and the largest parameter at the end."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class FSDPOnCPU(Trainer):
        # By hand, what accelerate does on a GPU machine: the FSDP path with the plugin
        # the Trainer built from its arguments.
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if self.args.fsdp_plugin_args is None:
                return
            PartialState().distributed_type = DistributedType.FSDP
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
                **self.args.fsdp_plugin_args
            )
            self.is_fsdp_enabled = True

    losses: list[float] = []

    seen: dict = {"grad_l1s": [], "largest_grads": [], "grad_norms": []}

    class RecordLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                seen["grad_norms"].append(float(logs["grad_norm"]))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            seen["grad_l1s"].append(sum(float(g.abs().sum()) for g in grads))
            seen["largest_grads"].append(max(float(g.abs().max()) for g in grads if g.numel()))

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fsdp_args = {}
    if fsdp_version is not None:
        fsdp_config = {"version": fsdp_version, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
        if fsdp_version == 1:
            # Module states are identical on every rank already; syncing them needs an
            # accelerator device in accelerate (FSDP2 has no such setting).
            fsdp_config["sync_module_states"] = False
        fsdp_args = dict(fsdp="full_shard auto_wrap", fsdp_config=fsdp_config)
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, max_steps=2 * STEPS, save_steps=STEPS,
        per_device_train_batch_size=2, logging_steps=1, report_to=[], learning_rate=TRAINER_LR,
        adam_epsilon=ADAMW_EPS, max_grad_norm=TRAINER_MAX_GRAD_NORM,
        lr_scheduler_type="constant", seed=0, **fsdp_args,
    )  # fmt: skip
    trainer = FSDPOnCPU(
        model=build_model("gpt2"), args=args, train_dataset=_TokenData(), callbacks=[RecordLoss()]
    )
    trainer.train(resume_from_checkpoint=resume)
    if record is not None:
        record.update(seen)
        record["largest_param"] = max(float(p.abs().max()) for p in trainer.model.parameters())
    return trainer, losses
