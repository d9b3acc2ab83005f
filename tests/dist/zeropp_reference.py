"""A one-process reference for ZeRO++ training, and the faults that show the check can fail.

[Note: the ZeRO++ reference]
Each rank's step is redone in one process, with no collective: the same model, unsharded,
runs every rank's micro-batch, and the reference applies ZeRO++'s arithmetic itself with
``base/quantize.py``'s codec, per unit, on the unit's flat buffer (the parameters end to
end at their layout offsets, zero padding up to ``num_shards`` equal shards):

* qwZ: shard ``r`` of the flat weights is quantized as one row and dequantized, as rank
  ``r`` sends it; every rank's forward and backward run on those values (qwZ quantizes
  every gather of a unit, backward's and a recompute's too, and hpZ's secondary shard holds
  the same values, so the reference holds for every strategy; whether backward gathered
  within the hpZ group is a question of bytes, checked by the traffic tests).
* qgZ: chunk ``c`` of rank ``r``'s flat gradient is quantized and dequantized for every
  ``r != c`` (the owner keeps its own part unquantized), the parts are added in rank
  order in fp32, then divided by the number of ranks.
* without qgZ the parts are added in rank order unquantized: at two ranks that is the
  only order there is (``a + b == b + a`` in IEEE arithmetic), so this is bit-exact.

The optimizer is plain SGD with a power-of-two learning rate: ``lr * grad`` is then exact
in fp32 (barring subnormals), so the update ``p - lr * grad`` rounds once whether a kernel
fuses it into one multiply-add or not, and the reference's parameters stay bit-identical
on every CPU and vector width. (Adam would hide a missing ``1/N``: its step does not
depend on the gradient's scale.) So gradients and parameters are compared bit for bit.

The faults (:func:`faulty`) put a bug into the rank worker's reduction, for the negative
controls that show the comparison catches each one.
"""

from __future__ import annotations

import contextlib
import copy
import enum
from dataclasses import dataclass

import torch
from torch import nn

from shardwrap.base.quantize import BlockCodec, dequantize, quantize
from shardwrap.comm import quantized
from shardwrap.features import grad_clip

# A power of two, see [Note: the ZeRO++ reference].
SGD_LR = 0.25


@dataclass(frozen=True, slots=True)
class UnitGeometry:
    """One unit's flat buffer: ``(fqn, offset, numel)`` per parameter, its padded size."""

    params: tuple[tuple[str, int, int], ...]
    padded_numel: int
    num_shards: int


def geometry(sharded) -> list[UnitGeometry]:
    """The units' flat buffers, from the sharded model's layouts (shape only: no values)."""
    units = []
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        layout = handle.layout
        assert all(info.requires_grad for info in layout.params)  # gradients in param layout
        params = tuple((info.fqn, info.offset, info.numel) for info in layout.params)
        units.append(UnitGeometry(params, layout.padded_numel, layout.num_shards))
    return units


def _flatten(values: dict[str, torch.Tensor], unit: UnitGeometry) -> torch.Tensor:
    flat = torch.zeros(unit.padded_numel)
    for fqn, offset, numel in unit.params:
        flat[offset : offset + numel] = values[fqn].reshape(-1)
    return flat


def _quantized(row: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    return dequantize(quantize(row, codec), row.numel(), codec)


class Reference:
    """The model trained as [Note: the ZeRO++ reference] says, in this process."""

    def __init__(
        self,
        model: nn.Module,
        units: list[UnitGeometry],
        *,
        weight_codec: BlockCodec | None,
        grad_codec: BlockCodec | None,
    ) -> None:
        self.model = model  # the fp32 masters
        self.compute = copy.deepcopy(model)  # what forward and backward run on
        self.units = units
        self.weight_codec = weight_codec
        self.grad_codec = grad_codec

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def step(
        self,
        loss_of,
        world_size: int,
        num_micro: int = 1,
        clip_factor: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """One step on every rank's micro-batches (``loss_of(model, rank, micro)``, their
        gradients accumulated, as under ``no_sync``): the averaged gradients (before any
        clipping), after SGD has applied them, each times ``clip_factor`` (a float32
        scalar) where given."""
        self._load_compute_weights()
        local = [self._local_grads(loss_of, rank, num_micro) for rank in range(world_size)]
        grads = {}
        for unit in self.units:
            grads.update(self._reduced(unit, [_flatten(g, unit) for g in local]))
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                grad = grads[name] if clip_factor is None else grads[name] * clip_factor
                param.add_(grad, alpha=-SGD_LR)
        return grads

    def _load_compute_weights(self) -> None:
        masters = self.params()
        values = dict(masters)
        if self.weight_codec is not None:
            for unit in self.units:
                rows = _flatten(masters, unit).view(unit.num_shards, -1)
                flat = torch.cat([_quantized(row, self.weight_codec) for row in rows])
                for fqn, offset, numel in unit.params:
                    values[fqn] = flat[offset : offset + numel].view_as(masters[fqn])
        with torch.no_grad():
            for name, param in self.compute.named_parameters():
                param.copy_(values[name])

    def _local_grads(self, loss_of, rank: int, num_micro: int) -> dict[str, torch.Tensor]:
        self.compute.zero_grad(set_to_none=True)
        for micro in range(num_micro):  # accumulated in .grad, as autograd does
            loss_of(self.compute, rank, micro).backward()
        return {name: p.grad.detach().clone() for name, p in self.compute.named_parameters()}

    def _reduced(self, unit: UnitGeometry, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Chunk ``c`` of the sum is the ranks' chunks ``c`` added in rank order, each
        quantized once unless it is the owner's ([Note: the ZeRO++ reference])."""
        num_ranks = len(flats)
        chunks = []
        for owner in range(unit.num_shards):
            total = None
            for rank, flat in enumerate(flats):
                part = flat.view(unit.num_shards, -1)[owner]
                if self.grad_codec is not None and rank != owner:
                    part = _quantized(part, self.grad_codec)
                total = part.clone() if total is None else total.add_(part)
            chunks.append(total)
        mean = torch.cat(chunks).div_(num_ranks)
        return {
            fqn: mean[offset : offset + numel].view_as(self.model.get_parameter(fqn))
            for fqn, offset, numel in unit.params
        }


def mismatches(sharded, expected: dict[str, torch.Tensor], *, grads: bool) -> list[str]:
    """Each shard view (its gradient when ``grads``) against its slice of ``expected``,
    bit for bit: the parameters that differ (a list, so that ranks never diverge on it)."""
    found = []
    for unit in sharded.units:
        handle = unit.handle
        if handle is None:
            continue
        pieces = handle.layout.pieces(handle.shard_comm.rank)
        for info, piece, shard in zip(handle.layout.params, pieces, handle.shard_params):
            want = expected[info.fqn].reshape(-1)[piece.param_start : piece.param_end]
            got = shard.grad if grads else shard.detach()
            if got is None:
                found.append(f"{info.fqn}: no gradient")
            elif not torch.equal(got.reshape(-1), want):
                diff = (got.reshape(-1) - want).abs().max().item()
                found.append(f"{info.fqn}{' grad' if grads else ''}: max diff {diff:.3g}")
    return found


class Fault(enum.Enum):
    """A bug put into the rank worker, for a negative control."""

    DOUBLE_COUNT = "double_count"  # qgZ adds this rank's own part twice
    NO_MEAN = "no_mean"  # qgZ's sum is never divided by the number of ranks
    ZERO_GRADS = "zero_grads"  # qgZ's reduced gradient is zeros
    QGZ_UNQUANTIZED = "qgz_unquantized"  # the gradient reduction ignores its codec
    QWZ_UNQUANTIZED = "qwz_unquantized"  # the weight all-gather ignores its codec
    LOCAL_NORM = "local_norm"  # clipping takes the norm of this rank's shards alone
    NO_REPLICA_SUM = "no_replica_sum"  # hybrid qgZ skips the sum across replica groups


class _Faulted:
    """A reduce-scatter's waitable whose wait then breaks the result as ``fault`` says."""

    def __init__(self, work, fault: Fault, out_shard, own, num_ranks: int) -> None:
        self._work = work
        self._fault = fault
        self._out = out_shard
        self._own = own  # this rank's unquantized part (alive until the wait)
        self._num_ranks = num_ranks

    def wait(self) -> bool:
        self._work.wait()
        with torch.no_grad():
            if self._fault is Fault.DOUBLE_COUNT:
                self._out.add_(self._own)
            elif self._fault is Fault.NO_MEAN:  # undoes the division that follows
                self._out.mul_(self._num_ranks)
            else:
                self._out.zero_()
        return True


@contextlib.contextmanager
def faulty(fault: Fault | None):
    """Run the block with ``fault`` put into shardwrap's ZeRO++ (None: as it is)."""
    originals = (quantized.reduce_scatter, quantized.all_gather, quantized.all_reduce)
    reduce_scatter, all_gather, _ = originals
    norm = grad_clip.sharded_grad_norm

    def faulty_reduce_scatter(comm, out_shard, in_full, **kwargs):
        if fault is Fault.QGZ_UNQUANTIZED:
            return reduce_scatter(comm, out_shard, in_full, **{**kwargs, "codec": None})
        work = reduce_scatter(comm, out_shard, in_full, **kwargs)
        own = in_full.view(comm.size, -1)[comm.rank]
        return _Faulted(work, fault, out_shard, own, comm.size)

    def faulty_all_gather(comm, out_full, in_shard, **kwargs):
        return all_gather(comm, out_full, in_shard, **{**kwargs, "codec": None})

    def local_norm(runtime, parameters, norm_type):
        grads = [p.grad for p in parameters if p.grad is not None]
        return torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt(), grads

    def no_replica_sum(comm, tensor, **kwargs):
        return _Done()

    if fault in (Fault.DOUBLE_COUNT, Fault.NO_MEAN, Fault.ZERO_GRADS, Fault.QGZ_UNQUANTIZED):
        quantized.reduce_scatter = faulty_reduce_scatter
    elif fault is Fault.QWZ_UNQUANTIZED:
        quantized.all_gather = faulty_all_gather
    elif fault is Fault.LOCAL_NORM:
        grad_clip.sharded_grad_norm = local_norm
    elif fault is Fault.NO_REPLICA_SUM:
        quantized.all_reduce = no_replica_sum
    try:
        yield
    finally:
        quantized.reduce_scatter, quantized.all_gather, quantized.all_reduce = originals
        grad_clip.sharded_grad_norm = norm


class _Done:
    """A collective's waitable that did nothing (a fault's)."""

    def wait(self) -> bool:
        return True
