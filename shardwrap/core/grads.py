"""A unit's gradients: flattened, reduced across ranks, handed to the shard views.

The gradient half of :class:`~shardwrap.flat_param.FlatParamHandle`: the handle builds
one :class:`UnitGrads` from its layout, views and communicators and holds it as
``handle.grads``. The tensor work itself is in :mod:`.grad_transfer`; where each gradient
goes in the flat buffer, in :mod:`shardwrap.layout.grad_slots` ([Note: packed gradients]).

[Note: gradients in a grad store]
A reduced gradient shard normally lives in ordinary memory from the unit's reduction to
``zero_grad``: for a model whose state exceeds the machine's memory, all of them together
(4 bytes per parameter element of the shard) are one more full-size copy. With a grad
store (``DiskOffload``'s disk store, :meth:`UnitGrads.keep_reduced_in`), each reduced
chunk is cast into a buffer the store hands out (a mapped file, kept from step to step
while nothing else holds it), its pages are released at once ([Note: releasing mapped
pages where they are touched] in base/pages.py), and the shard views' gradients are views
of it; the streamed optimizer step reads them back a sub-group at a time. The cast and
the scaling are the ones done in memory, in the same order, so the values are the same
bit for bit.

A float16 sum may be divided around the sum instead: :mod:`.grad_division`.

HSDP's knobs (a skipped replica all-reduce, the all-reduce hook): :mod:`.replica_grads`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base.pages import release_resident
from ..base.quantize import BlockCodec
from ..comm import quantized, user_comms
from ..comm.collectives import Communicator
from ..comm.pairwise import PeerSlices
from ..layout.flat import FlatLayout
from ..layout.grad_slots import GradSlots, chunk_split, peer_slices
from .grad_buffers import ReusableGradBuffer, ScratchPool
from .grad_division import divide_after_sum, divide_before_sum
from .grad_transfer import assign_reduced, flatten_local_grads
from .replica_grads import ReplicaGrads
from .storage import GradStore, HostStorage
from .tensor_parallel import TPSpec


@dataclass
class _Reduction:
    """A gradient reduction in flight: its waitable, where it lands, and its live input."""

    work: Any
    output: torch.Tensor  # 1D: the reduced shard (or the whole flat gradient, one shard)
    flat_grad: torch.Tensor  # 1D, padded: kept alive until the collective is done
    replicate_done: bool  # the replica all-reduce already ran as the first stage


def checked_divide_factor(factor: object) -> float:
    """``factor`` as a gradient divisor: a positive, finite number (errors name it)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"factor: expected a number, got {type(factor).__name__}")
    if not 0 < factor < float("inf"):
        raise ValueError(f"factor: {factor} must be a positive, finite number")
    return float(factor)


class UnitGrads:
    """Gradient reduction of one unit (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: FlatLayout,
        full_params: list[nn.Parameter],
        shard_params: list[nn.Parameter],
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        compute_device: torch.device,
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
        host_staging: HostStorage | None,
        comm_label: str,
        tp_specs: list[TPSpec | None] | None = None,
    ) -> None:
        self.layout = layout  # the handle's; replaced by rename()
        self.full_params = full_params  # the handle's full views (local gradients land here)
        self.shard_params = shard_params  # the handle's shard views (reduced gradients go here)
        self.dtype = dtype  # the shard's (master) dtype: reduced gradients end in it
        self.compute_dtype = compute_dtype  # local gradients'
        self.reduce_dtype = reduce_dtype  # the collectives'
        self.compute_device = compute_device
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.host_staging = host_staging  # CPUOffload: reduced gradients go to the host
        self.comm_label = comm_label  # the unit's name in the collectives' records
        # DTensor parameters: their gradients are flattened as local blocks
        # ([Note: ZeRO over tensor-parallel parameters] in core/tensor_parallel.py).
        self.tp_specs = tp_specs if tp_specs is not None else [None] * len(full_params)
        self._local_grad = self._tp_local_grad if any(self.tp_specs) else None
        # Where local gradients go before the reduction: [Note: packed gradients]
        self.grad_slots = GradSlots.for_layout(self.layout)
        # Each parameter's [start, end) in this rank's reduced chunk.
        self._reduced_pieces = [
            self.grad_slots.piece_in_chunk(index, self.shard_comm.rank)
            for index in range(len(self.layout.params))
        ]
        self._slices = PeerSlices(*peer_slices(layout, self.grad_slots, self.shard_comm.rank))
        # How one split_with_sizes cuts the chunk into those pieces.
        self._chunk_split = chunk_split(self._reduced_pieces, self.grad_slots.chunk_numel)
        # Reduced gradient of this backward, waiting for the presence vote (1D, a chunk).
        self.pending_grad_shard: torch.Tensor | None = None
        self.local_grad_present = [False] * len(self.layout.params)
        self._reductions: list[_Reduction] = []  # gradient reductions issued, not yet waited
        self._grad_buffer = ReusableGradBuffer()  # plain data parallel only
        # qgZ: quantize the reduce-scatter ([Note: ZeRO++ in a unit] in core/comm_quant.py)
        self.grad_codec: BlockCodec | None = None
        self.grad_store: GradStore | None = None  # [Note: gradients in a grad store]
        # (parameter index, its reduced 1D piece) -> what its shard view's ``.grad`` is; the
        # FSDP2 door's shard views are DTensors, so their gradients are too. None: the piece.
        self.shard_grad_view: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        # What the summed gradient is divided by; None: the data-parallel size (the mean).
        self._divide_factor: float | None = None
        self.replicas = ReplicaGrads()  # FSDP2's HSDP knobs (core/replica_grads.py)
        self.divides_around_reduction = False  # [Note: float16 reductions divided around the sum]

    def divide_around_reduction(self) -> None:
        """Divide as FSDP2 divides float16 sums from now on ([Note: float16 reductions
        divided around the sum])."""
        self.divides_around_reduction = True

    def set_divide_factor(self, factor: float | None) -> None:
        """Divide the summed gradient by ``factor`` from now on (None: by the number of
        data-parallel ranks, the mean). FSDP2's ``set_gradient_divide_factor``: 1.0 sums."""
        self._divide_factor = None if factor is None else checked_divide_factor(factor)

    @property
    def gradient_divisor(self) -> float:
        """What the summed gradient is divided by (see :meth:`set_divide_factor`)."""
        factor = self._divide_factor
        return self.data_parallel_size if factor is None else factor

    def keep_reduced_in(self, store: GradStore) -> None:
        """Keep reduced gradients in ``store`` from now on ([Note: gradients in a grad store])."""
        self.grad_store = store

    def rename(self, layout: FlatLayout, comm_label: str) -> None:
        """Follow the handle's :meth:`~shardwrap.flat_param.FlatParamHandle.rename`."""
        self.layout = layout
        self.comm_label = comm_label

    @property
    def num_shards(self) -> int:
        return self.layout.num_shards

    @property
    def reduces_in_place(self) -> bool:
        """Whether the gradient reduction is one all-reduce in place (plain data parallel)."""
        return self.num_shards == 1 and self.replicate_comm is not None

    @property
    def data_parallel_size(self) -> int:
        replicas = self.replicate_comm.size if self.replicate_comm is not None else 1
        return self.num_shards * replicas

    def start_reduce_grads(self, scratch: ScratchPool | None = None, user: Any = None) -> None:
        """Issue the gradient reduction without waiting; :meth:`finish_reduce_grads` ends it.

        Parameters without a local gradient contribute zeros; whether they get a gradient
        at all is decided by the presence vote (:meth:`assign_grads`).

        ``scratch``: where a sharded unit's flat gradient (the reduce-scatter's input) comes
        from; a new buffer when None. ``user``: a user's reduce-scatter object, which
        allocates both buffers (comm/user_comms.py).
        """
        if self.reduces_in_place:  # the all-reduce is the first (and only) stage
            flat_grad = self.take_local_grads(self._dp_grad_buffer())
            work = self.replicate_comm.all_reduce(flat_grad, purpose="grads", unit=self.comm_label)
            self._reductions.append(_Reduction(work, flat_grad, flat_grad, replicate_done=True))
            return
        if user is not None and self.shard_comm.size > 1:  # [Note: user communicators]
            numels = (self.flat_grad_numel, self.grad_slots.chunk_numel)
            dtype, device = self.reduce_dtype, self.compute_device
            args = (self.shard_comm, user, self.take_local_grads, numels, dtype, device)
            work, reduced, flat_grad = user_comms.reduce_scatter_grads(*args, unit=self.comm_label)
            self._reductions.append(_Reduction(work, reduced, flat_grad, replicate_done=False))
            return
        out = None
        if scratch is not None:
            out = scratch.take(self.flat_grad_numel, self.reduce_dtype, self.compute_device)
        flat_grad = self.take_local_grads(out)
        reduced = torch.empty(
            self.grad_slots.chunk_numel, dtype=self.reduce_dtype, device=flat_grad.device
        )
        work = quantized.reduce_scatter(
            self.shard_comm,
            reduced,
            flat_grad,
            purpose="grads",
            unit=self.comm_label,
            codec=self.grad_codec,
            slices=self._slices,
        )
        self._reductions.append(_Reduction(work, reduced, flat_grad, replicate_done=False))

    def _dp_grad_buffer(self) -> torch.Tensor:
        """The plain data-parallel flat gradient, see [Note: reusing the data-parallel
        gradient buffer]. A reduction in flight or pending holds the view it was given,
        so its buffer is not handed out again until the gradients are gone.
        """
        return self._grad_buffer.take(self.flat_grad_numel, self.reduce_dtype, self.compute_device)

    def finish_reduce_grads(self) -> None:
        """Wait for the reductions in flight and add them to ``pending_grad_shard``."""
        for reduction in self._reductions:
            reduction.work.wait()
            self.accept_reduced(reduction.output, replicate_done=reduction.replicate_done)
        self._reductions.clear()

    def discard_reductions(self, *, drop_grads: bool = False) -> None:
        """Wait for the reductions in flight and drop them, with the reduced gradient not
        yet assigned and what skipped replica all-reduces kept (a failed step's: [Note: a
        step abandoned by an exception] in runtime/step.py); with ``drop_grads`` also the
        local gradients on the full views and the shard views' ``.grad``."""
        for reduction in self._reductions:
            reduction.work.wait()
        self._reductions.clear()
        self.pending_grad_shard = None
        self.local_grad_present = [False] * len(self.layout.params)
        self.replicas.discard()
        for param in (*self.full_params, *self.shard_params) if drop_grads else ():
            param.grad = None

    def take_local_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The local gradients as one flat, padded ``reduce_dtype`` tensor (full views cleared).

        ``out`` (1D, :attr:`flat_grad_numel` elements of ``reduce_dtype``): write them there.
        """
        if out is None:
            flat_grad = self._flatten_local_grads().to(self.reduce_dtype)
        elif out.dtype == self.compute_dtype:
            flat_grad = self._flatten_local_grads(out)
        else:
            flat_grad = out.copy_(self._flatten_local_grads())
        divide_before_sum(flat_grad, self.gradient_divisor, around=self.divides_around_reduction)
        return flat_grad

    @property
    def flat_grad_numel(self) -> int:
        """Elements of the flat gradient :meth:`take_local_grads` returns (padded)."""
        return self.grad_slots.numel

    def accept_reduced(self, reduced: torch.Tensor, *, replicate_done: bool) -> None:
        """Finish a reduction of this rank's chunk (1D, chunk_numel): replicas, scale, add."""
        if self.replicate_comm is not None and not replicate_done:
            if not self.replicas.all_reduce_grads:  # kept for the next backward's
                self.replicas.keep(reduced)
                return
            self.replicas.add_kept(reduced)
            quantized.all_reduce(  # qgZ: hierarchical, quantized across replicas too
                self.replicate_comm,
                reduced,
                purpose="grads",
                unit=self.comm_label,
                codec=self.grad_codec,
            ).wait()
        if self.grad_store is not None and self.pending_grad_shard is None:
            self.pending_grad_shard = self._stored(reduced)
            return
        divisor = divide_after_sum(
            reduced, self.gradient_divisor, around=self.divides_around_reduction
        )
        reduced = self.replicas.divide(reduced.to(self.dtype), divisor)
        if self.host_staging is not None:  # the optimizer steps on the host
            reduced = self.host_staging.to_host(reduced)
        if self.pending_grad_shard is None:
            self.pending_grad_shard = reduced
        else:
            self.pending_grad_shard.add_(reduced)
            release_resident(self.pending_grad_shard)

    def _stored(self, reduced: torch.Tensor) -> torch.Tensor:
        """``reduced`` cast and scaled into the grad store's buffer, its pages released."""
        store = self.grad_store
        assert store is not None
        kept = store.grad_buffer(self, self.comm_label, reduced.numel(), self.dtype)
        divisor = divide_after_sum(
            reduced, self.gradient_divisor, around=self.divides_around_reduction
        )
        self.replicas.divide(kept.copy_(reduced), divisor)
        release_resident(kept)
        return kept

    def _flatten_local_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        flat_grad = out
        if flat_grad is None:
            flat_grad = torch.empty(
                self.grad_slots.numel, dtype=self.compute_dtype, device=self.compute_device
            )
        flatten_local_grads(
            flat_grad, self.grad_slots, self.full_params, self.local_grad_present, self._local_grad
        )
        return flat_grad

    def _tp_local_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        spec = self.tp_specs[index]
        return grad if spec is None else spec.local_grad(grad, self.shard_comm.ledger)

    def assign_grads(self, global_present: list[bool]) -> None:
        """Move the pending reduced gradient onto the shard views that got one anywhere."""
        pending = self.pending_grad_shard
        self.pending_grad_shard = None
        self.local_grad_present = [False] * len(self.full_params)
        present = self.replicas.presence(global_present, waits=pending is None)
        if present is None:  # the skipped backward's flags wait with its kept sum
            return
        if pending is not None:
            assign_reduced(
                self.shard_params,
                self._piece_finder(pending),
                pending,
                present,
                pending_is_kept=self._pending_is_kept or self.grad_store is not None,
                view=self.shard_grad_view,
            )
            if self.grad_store is not None:  # accumulated into: release what was touched
                for param in self.shard_params:
                    if param.grad is not None:
                        release_resident(param.grad)
                release_resident(pending)  # read again by an accumulation's add

    def _piece_finder(self, reduced_chunk: torch.Tensor) -> Callable[[int], torch.Tensor]:
        """``index -> _grad_piece(reduced_chunk, index)``, with the chunk cut up once."""
        sizes, part_of = self._chunk_split
        parts = reduced_chunk.split_with_sizes(sizes) if sizes else ()
        params = self.layout.params
        one_shard = self.num_shards == 1

        def piece(index: int) -> torch.Tensor:
            part = part_of[index]
            if part is None:
                return self._grad_piece(reduced_chunk, index)
            return parts[part].view(params[index].shape) if one_shard else parts[part]

        return piece

    def _grad_piece(self, reduced_chunk: torch.Tensor, index: int) -> torch.Tensor:
        # Parameter ``index``'s part of this rank's reduced chunk, shaped like its shard view.
        start, end = self._reduced_pieces[index]
        piece = reduced_chunk[start:end]
        return piece.view(self.layout.params[index].shape) if self.num_shards == 1 else piece

    @property
    def _pending_is_kept(self) -> bool:
        # The pending gradient is (part of) a data-parallel buffer kept between steps: an
        # in-place all-reduce's output, neither cast to the master dtype nor staged to host.
        uncast = self.reduce_dtype == self.dtype
        return self.reduces_in_place and uncast and self.host_staging is None

    def late_grad_names(self) -> list[str]:
        """Parameters whose local gradient arrived after this unit was reduced."""
        return [
            info.fqn
            for info, p in zip(self.layout.params, self.full_params, strict=True)
            if p.grad is not None
        ]
