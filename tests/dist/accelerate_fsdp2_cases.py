"""Rank workers for tests/dist/test_accelerate_fsdp2.py: accelerate's FSDP2 path, run twice.

The script is an accelerate training loop as its users write it: ``Accelerator`` with a
``FullyShardedDataParallelPlugin(fsdp_version=2, ...)``, ``prepare(model, optimizer)``
(accelerate's ``fsdp2_prepare_model`` calls ``fully_shard`` on each decoder layer, the
input embedding, the ``[final norm, lm_head]`` tail as a list, then the root, and
switches the optimizer onto the DTensor parameters), ``backward``, ``clip_grad_norm_``,
AdamW, and ``save_state``/``load_state``. It runs once with torch's ``fully_shard`` and
once after ``shardwrap.install()`` (which rebinds the name accelerate imports inside
``fsdp2_prepare_model``); the test compares the records.

accelerate picks its FSDP path only on accelerators; on CPU it sets up the gloo group as
``MULTI_CPU``, and ``make_accelerator`` selects the FSDP path by hand, as a GPU machine
would (as tests/dist/hf_frameworks.py does for FSDP1).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import shardwrap
from shardwrap.fsdp2 import FSDPModule as DoorModule
from tests.dist import hf_frameworks as hf

CLIP_NORM = 0.5  # under the gradients' norm here, so clipping changes every step
LR = 1e-2


def make_accelerator(kind: str, *, mixed_precision: str = "no", accumulation: int = 1, **plugin):
    """An ``Accelerator`` on the running gloo group, on accelerate's FSDP2 path;
    ``plugin``: more ``FullyShardedDataParallelPlugin`` fields."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[hf.layer_class(kind)],
        **plugin,
    )
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=plugin,
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=accumulation,
    )
    # By hand, what accelerate does on a GPU machine: the FSDP path, the plugin's precision.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def train(
    rank: int,
    kind: str,
    *,
    first_step: int,
    num_steps: int,
    load_from: str | None = None,
    save_to: str | None = None,
    **options,
) -> dict:
    """Train ``num_steps`` AdamW steps from ``first_step`` (after ``load_state`` if
    given, ``save_state`` after if given): losses, gradient norms, full parameters.
    ``options``: ``make_accelerator``'s; with ``accumulation``, that many microbatches
    per step under ``accelerator.accumulate``."""
    from torch.distributed.fsdp import FSDPModule

    accelerator = make_accelerator(kind, **options)
    model = hf.build_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if load_from is not None:
        accelerator.load_state(load_from)
    losses, norms = [], []
    microbatches = options.get("accumulation", 1)
    for step in range(first_step, first_step + num_steps):
        for micro in range(microbatches):
            with accelerator.accumulate(model):
                ids = hf.batch(microbatches * step + micro, rank)
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), CLIP_NORM)
                    norms.append(norm.item())
                optimizer.step()
                optimizer.zero_grad()
                losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    if save_to is not None:
        accelerator.save_state(save_to)
    # accelerate's full state dict (get_model_state_dict, full, CPU, on rank 0 only)
    full_state = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    return {
        "full_state_dict": full_state,
        "losses": losses,
        "grad_norms": norms,
        "params": full_params(model),
        "wrapper": type(model).__name__,
        "num_fsdp": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "door": isinstance(model, DoorModule),
        "optimizer_holds_model_params": _optimizer_holds(model, optimizer),
    }


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value on this rank, by the Hugging Face model's names."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = full.detach().float().clone()
    return out


def _optimizer_holds(model: torch.nn.Module, optimizer) -> bool:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return held == {id(p) for p in model.parameters()}


def straight_runs(rank: int, world_size: int, kind: str, options: dict) -> dict:
    """torch's FSDP2 and shardwrap's (after ``install()``) through ``2 * hf.STEPS`` steps."""
    hf.set_launcher_env(rank, world_size)
    out = {"torch": train(rank, kind, first_step=0, num_steps=2 * hf.STEPS, **options)}
    shardwrap.install()
    try:
        out["shardwrap"] = train(rank, kind, first_step=0, num_steps=2 * hf.STEPS, **options)
    finally:
        shardwrap.uninstall()
    return out


def runs(rank: int, world_size: int, kind: str, options: dict, folder: str, control=None) -> dict:
    """The script's runs on this rank: torch's FSDP2 straight through ``2 * hf.STEPS``
    steps, and after ``shardwrap.install()`` the same; torch's first ``hf.STEPS`` steps
    saved (``save_state``) and resumed on shardwrap (``load_state``); shardwrap's first
    steps saved and resumed on shardwrap, and on torch's FSDP2. ``options``: ``train``'s
    accelerate settings; ``control``: a ``fully_shard`` bound in torch's place over
    shardwrap's (a negative control's bug)."""
    from torch.distributed import fsdp as torch_fsdp

    hf.set_launcher_env(rank, world_size)
    steps = hf.STEPS
    out = {
        "torch": train(rank, kind, first_step=0, num_steps=2 * steps, **options),
        "torch_first": train(
            rank, kind, first_step=0, num_steps=steps, save_to=f"{folder}/torch", **options
        ),
    }
    shardwrap.install()
    if control is not None:
        torch_fsdp.fully_shard = control
    try:
        out["shardwrap"] = train(rank, kind, first_step=0, num_steps=2 * steps, **options)
        out["resumed_from_torch"] = train(
            rank, kind, first_step=steps, num_steps=steps, load_from=f"{folder}/torch", **options
        )
        out["shardwrap_first"] = train(
            rank, kind, first_step=0, num_steps=steps, save_to=f"{folder}/ours", **options
        )
        out["resumed"] = train(
            rank, kind, first_step=steps, num_steps=steps, load_from=f"{folder}/ours", **options
        )
    finally:
        shardwrap.uninstall()
    out["torch_resumed_from_shardwrap"] = train(
        rank, kind, first_step=steps, num_steps=steps, load_from=f"{folder}/ours", **options
    )
    return out


def refusal(rank: int, world_size: int, kind: str, options: dict) -> str:
    """What shardwrap's door raises when accelerate prepares the model with ``options``
    after ``install()`` (empty: nothing raised)."""
    hf.set_launcher_env(rank, world_size)
    shardwrap.install()
    try:
        train(rank, kind, first_step=0, num_steps=1, **options)
    except (ValueError, TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        shardwrap.uninstall()
    return ""


def trainer_runs(rank: int, world_size: int, folder: str, control=None) -> dict:
    """The Hugging Face ``Trainer``'s FSDP2 (``fsdp_config={"version": 2}``, which goes
    through accelerate's ``fsdp2_prepare_model``): torch's straight through; shardwrap's
    after ``install()`` straight through, resumed from its own checkpoint at ``hf.STEPS``
    and from torch's. Each run's logged losses and final full parameters. ``control``:
    as for :func:`runs`."""
    hf.set_launcher_env(rank, world_size)
    checkpoint = f"checkpoint-{hf.STEPS}"

    def run(output_dir: str, resume: str | None = None) -> dict:
        trainer, losses = hf.trainer_train(fsdp_version=2, output_dir=output_dir, resume=resume)
        model = trainer.model_wrapped
        return {
            "losses": losses,
            "params": full_params(model),
            "door": isinstance(model, DoorModule),
        }

    out = {"torch": run(f"{folder}/torch")}
    shardwrap.install()
    if control is not None:
        from torch.distributed import fsdp as torch_fsdp

        torch_fsdp.fully_shard = control
    try:
        out["shardwrap"] = run(f"{folder}/ours")
        out["resumed"] = run(f"{folder}/ours", resume=f"{folder}/ours/{checkpoint}")
        out["resumed_from_torch"] = run(f"{folder}/cross", resume=f"{folder}/torch/{checkpoint}")
    finally:
        shardwrap.uninstall()
    return out
