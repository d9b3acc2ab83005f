"""Rank workers for tests/dist/test_fsdp2_meta_init.py: FSDP2's meta-device init script.

The script builds fsdp2_cases.TinyModel under ``torch.device("meta")``, calls
``fully_shard`` on each block and then the root, ``model.to_empty(device="cpu")``, and
initialises in place on the sharded DTensor parameters: ``model.apply`` with
``nn.init`` (trunc_normal_/normal_/zeros_/ones_, torchtitan's way) or each module's own
``reset_parameters()``. Then AdamW steps as in fsdp2_cases.run_script. Every rank seeds
its default generator alike (``torch.manual_seed(0)``), as clients do: on a CPU mesh each
rank draws its own chunk from it ([Note: meta-device modules on the FSDP2 door]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import shardwrap
from tests.dist import fsdp2_cases as fc


class BufferedModel(fc.TinyModel):
    """TinyModel with a buffer (built on meta too, initialised after ``to_empty``, as
    torchtitan's rotary tables are; the state dicts compared hold it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(fc.DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.offset[: fc.OUT]


def init_weights(module: nn.Module) -> None:
    """torchtitan-like in-place init, on the DTensor parameters."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def reset_each(module: nn.Module) -> None:
    """Each module's own ``reset_parameters()`` (kaiming_uniform_ on Linear, and so on)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset) and not isinstance(module, BufferedModel):
        reset()


INITS: dict[str, Callable[[nn.Module], None]] = {"init_fn": init_weights, "reset": reset_each}
# Not an in-place init: the weights loaded with load_state_dict(assign=True) (load_assigned).
ASSIGN = "assign"


def load_assigned(model: nn.Module) -> None:
    """accelerate's ``fsdp2_load_full_state_dict``: a full model's weights (built and
    seeded alike on every rank), each ``distribute_tensor`` ed onto its sharded
    parameter's mesh and placements, loaded with ``load_state_dict(assign=True)``."""
    torch.manual_seed(0)
    full = BufferedModel().state_dict()
    sharded = {}
    for name, target in model.state_dict().items():
        if isinstance(target, DTensor):
            sharded[name] = distribute_tensor(full[name], target.device_mesh, target.placements)
        else:
            sharded[name] = full[name]
    model.load_state_dict(sharded, assign=True)


def copy_after_to_empty(model: nn.Module) -> None:
    """The negative control's bug: each parameter swapped for a fresh copy after
    ``to_empty`` (what ``nn.Module._apply`` does to a DTensor parameter: swap_tensors),
    so the init writes where the engine never reads."""
    with torch.no_grad():
        for param in model.parameters():
            copy = nn.Parameter(torch.empty_like(param), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, copy)


def run_meta_script(
    shard: Callable[..., nn.Module], rank: int, world_size: int, init: str, control: bool
) -> tuple[dict[str, torch.Tensor], fc.Record]:
    """The script with ``shard`` as its ``fully_shard``: the parameters right after init
    (``full_tensor()``), and the training record."""
    with torch.device("meta"):
        model = BufferedModel()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    if init == ASSIGN:
        load_assigned(model)
    else:
        model.to_empty(device="cpu")
        if control:
            copy_after_to_empty(model)
        torch.manual_seed(0)
        with torch.no_grad():
            model.apply(INITS[init])
    with torch.no_grad():
        model.offset.copy_(torch.linspace(-0.1, 0.1, fc.DIM))
    initial = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    record = fc.train_record(model, rank)
    return initial, record


def compare(rank: int, world_size: int, init: str, control: bool) -> list[str]:
    """torch's FSDP2 run, then shardwrap's (with the control's bug if ``control``); their
    differences, one line each (fsdp2_cases.differences, and the parameters after init)."""
    torch_initial, reference = run_meta_script(
        torch_fsdp.fully_shard, rank, world_size, init, False
    )
    dist.barrier()
    initial, ours = run_meta_script(shardwrap.fully_shard, rank, world_size, init, control)
    found = refusals(world_size) + (assign_refusals(world_size) if init == ASSIGN else [])
    found += [
        f"init: {n} differs" for n in torch_initial if not torch.equal(torch_initial[n], initial[n])
    ]
    return found + fc.differences(reference, ours)


def refusals(world_size: int) -> list[str]:
    """What shardwrap's door refuses around meta init, a line for each it lets through:
    a dtype conversion of the shards after ``fully_shard``."""
    with torch.device("meta"):
        model = BufferedModel()
    shardwrap.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    model.to_empty(device="cpu")
    try:
        model.to(torch.float64)
    except NotImplementedError as error:
        if "convert before it" in str(error) and model.offset.dtype == torch.float32:
            return []
    return ["model.to(torch.float64) after fully_shard: not refused before converting"]


def assign_refusals(world_size: int) -> list[str]:
    """What ``load_state_dict(assign=True)`` is refused on shardwrap's door before it
    assigns anything, a line for each it lets through: a plain tensor (FSDP2 needs a
    DTensor there), a DTensor in another dtype."""
    model = BufferedModel()
    shardwrap.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    view = model.head.weight
    full = torch.ones(view.shape)
    wrong = {
        TypeError: full,
        ValueError: distribute_tensor(full.double(), view.device_mesh, view.placements),
    }
    found = []
    for error_type, tensor in wrong.items():
        try:
            model.load_state_dict({"head.weight": tensor}, strict=False, assign=True)
        except error_type as error:
            if "'head.weight'" in str(error) and model.head.weight is view:
                continue
        found.append(f"assign {error_type.__name__}: not refused before assigning")
    return found
