"""Rank workers for tests/dist/test_fsdp2_custom_comms.py: ``set_custom_all_gather`` and
``set_custom_reduce_scatter`` with a user's communicator, under torch's FSDP2 and
shardwrap's door, running tests/dist/fsdp2_cases.py's script."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh

import shardwrap
from shardwrap.fsdp2.state import state_of
from tests.dist import fsdp2_cases as fc
from tests.dist import fsdp2_hsdp_cases as hc

# torch >= 2.13 names them *_single (the *_into_tensor names warn there); both delegate
# to the same process-group collective.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RecordingComm:
    """FSDP2's comm protocol, delegating to torch.distributed; counts its calls, its
    allocations, and what it was handed (for the test to compare)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "all_gather" | "reduce_scatter"
        self.calls = 0
        self.allocations = 0
        self.seen: Counter = Counter()  # (input numel, output numel, dtype, op)
        self.async_ops: Counter = Counter()  # the async_op values it was called with

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        self.calls += 1
        op_name = None if op is None else str(op)
        key = (input_tensor.numel(), output_tensor.numel(), str(input_tensor.dtype), op_name)
        self.seen[key] += 1
        self.async_ops[async_op] += 1
        if self.kind == "all_gather":
            return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)
        return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class ZeroingGather(RecordingComm):
    """A negative control: gathers synchronously, then zeroes what it gathered."""

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        super().__call__(output_tensor, input_tensor, group)  # synchronous: returns None
        output_tensor.zero_()


class NegatingReduceScatter(RecordingComm):
    """A negative control: reduce-scatters synchronously, then negates the result (a
    doubled one would not do: AdamW and clipping to a norm undo a scale)."""

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        super().__call__(output_tensor, input_tensor, group, op)
        output_tensor.neg_()


COMMS = {"recording": RecordingComm, "zeroing": ZeroingGather, "negating": NegatingReduceScatter}


class WithComms:
    """A ``fully_shard`` (torch's or shardwrap's) that sets one all-gather and one
    reduce-scatter object on every module it shards."""

    def __init__(self, shard, gather: str, reduce: str) -> None:
        self.shard = shard
        self.gather = COMMS[gather]("all_gather")
        self.reduce = COMMS[reduce]("reduce_scatter")
        self.per_step: list[tuple[int, int]] = []  # calls (gather, reduce) after each step
        self.ledger: Counter = Counter()  # shardwrap's: (kind, purpose, bytes) over the run

    def __call__(self, module: nn.Module, **kwargs) -> nn.Module:
        self.shard(module, **kwargs)
        module.set_custom_all_gather(self.gather)
        module.set_custom_reduce_scatter(self.reduce)
        return module

    def summary(self) -> dict:
        steps = [
            (g - g0, r - r0) for (g, r), (g0, r0) in zip(self.per_step, [(0, 0), *self.per_step])
        ]
        return {
            "calls_per_step": steps,
            "allocations": (self.gather.allocations, self.reduce.allocations),
            "gather_seen": dict(self.gather.seen),
            "reduce_seen": dict(self.reduce.seen),
            "async_ops": (set(self.gather.async_ops), set(self.reduce.async_ops)),
            "ledger": dict(self.ledger),
        }


_CURRENT: list[WithComms] = []  # the run in progress (after_step must pickle: module level)


def _note_calls(model: nn.Module, step: int) -> None:
    run = _CURRENT[-1]
    run.per_step.append((run.gather.calls, run.reduce.calls))
    state = state_of(model)
    if state is not None:  # shardwrap's: the root's ledger holds every unit's records
        records = state.root.comm_ledger.records
        run.ledger = Counter((r.kind, r.purpose, r.num_bytes) for r in records)


# Mixed precision as (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs): bf16
# gathers and fp32 reductions; fp16 both (FSDP2 then passes op=SUM too, dividing around it).
_BF16_FP32 = (torch.bfloat16, torch.float32, None, True)
_FP16 = (torch.float16, torch.float16, None, True)
SCRIPTS = {
    "fp32": fc.Script(after_step=_note_calls),
    "bf16_fp32_reduce": fc.Script(mp=_BF16_FP32, root_mp=_BF16_FP32, after_step=_note_calls),
    "fp16": fc.Script(mp=_FP16, root_mp=_FP16, after_step=_note_calls),
    # CPUOffloadPolicy on every call: shards on the host, staged for the gather
    "cpu_offload": fc.Script(offload="cpu", root_offload="cpu", after_step=_note_calls),
}


def _run(shard, rank: int, world_size: int, script: str, gather: str, reduce: str):
    dist.barrier()
    run = WithComms(shard, gather, reduce)
    _CURRENT.append(run)
    try:
        record = fc.run_script(run, rank, world_size, SCRIPTS[script])
    finally:
        _CURRENT.pop()
    return record, run.summary()


def custom_comms(rank: int, world_size: int, script: str, controls: bool) -> dict:
    """torch's FSDP2 and shardwrap's door running ``script``, each with recording
    communicators, and (``controls``) the negative controls on shardwrap's side: each
    one's differences from torch's run and what its communicators saw."""
    reference, torch_seen = _run(
        torch_fsdp.fully_shard, rank, world_size, script, *["recording"] * 2
    )
    found = {"torch": torch_seen}
    runs = [("ours", "recording", "recording")]
    if controls:
        runs += [
            ("zeroed_gather", "zeroing", "recording"),
            ("negated_reduce", "recording", "negating"),
        ]
    for name, gather, reduce in runs:
        record, seen = _run(shardwrap.fully_shard, rank, world_size, script, gather, reduce)
        found[name] = {**seen, "differences": fc.differences(reference, record)}
    return found


def refused_comm(rank: int, world_size: int, method: str, comm: object) -> str:
    """What ``method`` on a block gets for ``comm``."""
    model = fc.sharded_tiny_model(world_size)
    try:
        getattr(model.blocks[0], method)(comm)
    except (TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _model_on(mesh, **kwargs) -> fc.TinyModel:
    torch.manual_seed(0)
    model = fc.TinyModel()
    for block in model.blocks:
        shardwrap.fully_shard(block, mesh=mesh, **kwargs)
    shardwrap.fully_shard(model, mesh=mesh)
    return model


def refused_units(rank: int, world_size: int) -> dict:
    """What each method gets on a block resharded to pairs of ranks after forward (at 4
    ranks: its backward gathers over the pair)."""
    model = _model_on(init_device_mesh("cpu", (world_size,)), reshard_after_forward=2)
    found = {}
    for method in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        try:
            getattr(model.blocks[0], method)(RecordingComm("all_gather"))
            found["reshard_int", method] = "accepted"
        except NotImplementedError as error:
            found["reshard_int", method] = str(error)
    return found


def hsdp_custom_comms(rank: int, world_size: int) -> dict:
    """tests/dist/fsdp2_hsdp_cases.py's accumulating script on its (2, 2) mesh, torch's
    FSDP2 and shardwrap's door each with recording communicators (the shard group's
    collectives; the replica all-reduce stays each library's own): shardwrap's
    differences from torch's, and what each one's communicators saw."""
    script = hc.HsdpScript(accumulate=True)
    found, records = {}, {}
    for name, shard in (("torch", torch_fsdp.fully_shard), ("ours", shardwrap.fully_shard)):
        dist.barrier()
        run = WithComms(shard, "recording", "recording")
        records[name] = hc.run_script(run, rank, world_size, script)
        found[name] = {
            "calls": (run.gather.calls, run.reduce.calls),
            "allocations": (run.gather.allocations, run.reduce.allocations),
            "gather_seen": dict(run.gather.seen),
            "reduce_seen": {key[:3]: n for key, n in run.reduce.seen.items()},  # not op
        }
    found["ours"]["differences"] = hc.differences(records["torch"], records["ours"])
    return found


class KeepingGather(RecordingComm):
    """Gathers synchronously and keeps a copy of what it gathered (the first three)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.outputs: list[torch.Tensor] = []

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        super().__call__(output_tensor, input_tensor, group)
        if len(self.outputs) < 3:
            self.outputs.append(output_tensor.clone())


def gathered_outputs(rank: int, world_size: int) -> list[dict]:
    """The first forward's three gathers (root, block 0, block 1), torch's FSDP2's output
    against the door's: equal in size, in rank 0's part, and as sorted values."""
    outputs = {}
    for name, shard in (("torch", torch_fsdp.fully_shard), ("ours", shardwrap.fully_shard)):
        dist.barrier()
        run = WithComms(shard, "recording", "recording")
        run.gather = KeepingGather("all_gather")
        torch.manual_seed(0)
        model = fc.TinyModel()
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            run(block, mesh=mesh)
        run(model, mesh=mesh)
        with torch.no_grad():
            model(fc.batch(0, rank)[0])
        outputs[name] = run.gather.outputs
    found = []
    for theirs, ours in zip(outputs["torch"], outputs["ours"], strict=True):
        first = theirs.numel() // world_size
        found.append(
            {
                "sizes": theirs.numel() == ours.numel(),
                "rank_0_part": torch.equal(theirs[:first], ours[:first]),
                "whole": torch.equal(theirs, ours),
                "values": torch.equal(theirs.sort().values, ours.sort().values),
            }
        )
    return found
