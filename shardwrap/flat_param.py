"""One unit's parameters as a flat, sharded buffer, and its state machine.

[Note: two views of each parameter]
Every original parameter has two ``nn.Parameter`` objects, created once and kept for the
life of the handle:

* its *shard* view: this rank's piece of the parameter, a view into ``flat_shard``. It is
  what the module shows outside forward/backward, what the optimizer holds, and where
  reduced gradients land (``.grad``). Its identity never changes, so optimizer state stays
  attached.
* its *full* view: the whole parameter, a view into ``flat_full``. It is what the module
  shows while the unit computes; autograd accumulates local gradients into its ``.grad``.

``flat_full``'s storage is released (resized to 0) when the unit reshards and re-allocated
in place when it unshards, so the full views stay valid objects without holding memory.
With one shard, ``flat_full`` *is* ``flat_shard`` and nothing is ever gathered or freed,
unless mixed precision asks for a low-precision ``flat_full`` or ``CPUOffload`` keeps the
shard in host memory (``separate_full``; see ``[Note: mixed-precision data flow]`` in
``mixed_precision.py`` and ``[Note: host shards and staging]`` in ``host_offload.py``).

[Note: version counters]
Writing gathered data into ``flat_full`` must not bump its autograd version counter:
tensors saved for backward alias it, and the re-gather before backward writes the very
same values back. ``flat_shard``'s counter, on the other hand, is how we know the gathered
copy is stale: every in-place update of a shard view (an optimizer step, a user edit)
bumps the counter it shares with ``flat_shard``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .collectives import ROOT_LABEL, Communicator
from .grad_buffer import ReusableGradBuffer, ScratchPool
from .grad_transfer import assign_reduced, flatten_local_grads
from .host_offload import HostStaging, StagedShard
from .layout import FlatLayout, GradSlots
from .mixed_precision import HandlePrecision
from .options import ShardingStrategy

# (unit name, number of elements, dtype) -> a 1-D tensor to hold the unit's shard.
ShardAllocator = Callable[[str, int, torch.dtype], torch.Tensor]


class ShardedState(enum.Enum):
    SHARDED = "SHARDED"  # module shows shard views; flat_full freed (or kept stale, ZeRO-1)
    UNSHARDED = "UNSHARDED"  # module shows full views; flat_full holds gathered parameters


@dataclass
class _Reduction:
    """A gradient reduction in flight: its waitable, where it lands, and its live input."""

    work: Any
    output: torch.Tensor  # 1D: the reduced shard (or the whole flat gradient, one shard)
    flat_grad: torch.Tensor  # 1D, padded: kept alive until the collective is done
    replicate_done: bool  # the replica all-reduce already ran as the first stage


class ParamSite:
    """One place a parameter is registered: ``module._parameters[attr]``.

    A tied parameter has several sites and one entry in the layout.
    """

    __slots__ = ("module", "attr")

    def __init__(self, module: nn.Module, attr: str) -> None:
        self.module = module
        self.attr = attr

    def set(self, param: nn.Parameter) -> None:
        self.module._parameters[self.attr] = param


class FlatParamHandle:
    """A unit's parameters: the flat shard, the gathered buffer and gradient reduction."""

    def __init__(
        self,
        *,
        unit_name: str,
        layout: FlatLayout,
        params: list[nn.Parameter],
        sites: list[list[ParamSite]],
        shard_comm: Communicator,
        replicate_comm: Communicator | None,
        strategy: ShardingStrategy,
        precision: HandlePrecision | None = None,
        shard_allocator: ShardAllocator | None = None,
    ) -> None:
        _check_uniform(unit_name, layout, params)
        self.unit_name = unit_name
        self.layout = layout
        self.strategy = strategy
        self.shard_comm = shard_comm
        self.replicate_comm = replicate_comm
        self.sites = sites
        # Fixed at wrap time, as the layout's flags are; a unit with none never reduces.
        self.has_trainable_params = any(info.requires_grad for info in layout.params)
        # Where local gradients go before the reduction: [Note: packed gradients]
        self.grad_slots = (
            GradSlots.packed(layout) if self.reduces_in_place else GradSlots.along(layout)
        )
        self.state = ShardedState.UNSHARDED
        dtype, device = params[0].dtype, params[0].device
        self.dtype = dtype  # the shard's (master) dtype
        self.precision = precision  # None: compute and reduce in the master dtype
        self.compute_dtype = precision.param_dtype if precision else dtype
        self.reduce_dtype = precision.reduce_dtype if precision else dtype
        self.compute_device = device  # flat_full, local gradients and collectives
        # CPUOffload: the shard lives in host memory, see [Note: host shards and staging].
        self.host_staging = shard_allocator if isinstance(shard_allocator, HostStaging) else None
        # Whether flat_full is its own buffer (several shards, a low-precision or device copy).
        self.separate_full = (
            layout.num_shards > 1 or self.compute_dtype != dtype or self.host_staging is not None
        )
        flat_init = torch.zeros(layout.padded_numel, dtype=dtype, device=device)  # 1D, padded
        with torch.no_grad():
            for info, param in zip(layout.params, params, strict=True):
                flat_init[info.offset : info.end].copy_(param.detach().reshape(-1))
        start, end = layout.shard_range(shard_comm.rank)
        self.pieces = layout.pieces(shard_comm.rank)  # this rank's piece of each parameter
        # 1D, shard_numel elements; the same tensor as flat_full unless separate_full.
        self.flat_shard = flat_init if self.num_shards == 1 else flat_init[start:end].clone()
        if shard_allocator is not None:  # the shard lives elsewhere (DiskOffload: a mapped file)
            placed = shard_allocator(unit_name, layout.shard_numel, dtype)
            with torch.no_grad():
                placed.copy_(self.flat_shard)
            self.flat_shard = placed
            if self.num_shards == 1 and self.host_staging is None:
                flat_init = placed
        # 1D, padded, compute_dtype; storage released while resharded (if separate_full).
        self.flat_full = (
            flat_init  # released by the reshard below when separate_full
            if self.compute_dtype == dtype
            else torch.empty(layout.padded_numel, dtype=self.compute_dtype, device=device)
        )
        self.full_params = [self._make_full_view(i) for i in range(len(params))]
        self.shard_params = [self._make_shard_view(i) for i in range(len(params))]
        self._gathered_version: int | None = None  # flat_shard._version at the last gather
        # Reduced gradient of this backward, waiting for the presence vote (1D, shard_numel).
        self.pending_grad_shard: torch.Tensor | None = None
        self.local_grad_present = [False] * len(params)
        self._gather_work: Any = None  # an all-gather issued ahead (prefetch), not yet waited
        self._gather_input: torch.Tensor | None = None  # its input, alive until it is done
        self._gather_staged: StagedShard | None = None  # CPUOffload: its input and copy event
        self._gather_version: int | None = None  # flat_shard._version when it was issued
        # Restores flat_full's autograd version to what it was before that all-gather.
        self._gather_version_guard: Any = None
        self._reductions: list[_Reduction] = []  # gradient reductions issued, not yet waited
        self._grad_buffer = ReusableGradBuffer()  # plain data parallel only
        self.reshard(free=True)

    # ------------------------------------------------------------------ views
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

    def _make_full_view(self, index: int) -> nn.Parameter:
        info = self.layout.params[index]
        view = self.flat_full[info.offset : info.end].view(info.shape)
        return nn.Parameter(view, requires_grad=info.requires_grad)

    def _make_shard_view(self, index: int) -> nn.Parameter:
        view = self.shard_view(self.flat_shard, index)
        return nn.Parameter(view, requires_grad=self.layout.params[index].requires_grad)

    def shard_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s part of ``flat``, a buffer laid out like this rank's shard.

        A 1-D piece, or the parameter's own shape when there is a single shard.
        """
        info = self.layout.params[index]
        if self.num_shards == 1:
            return flat[info.offset : info.end].view(info.shape)
        piece = self.pieces[index]
        return flat[piece.shard_start : piece.shard_end]

    def _show(self, params: list[nn.Parameter]) -> None:
        for param, sites in zip(params, self.sites, strict=True):
            for site in sites:
                site.set(param)

    @property
    def comm_label(self) -> str:
        """The unit's name as its collectives are recorded."""
        return self.unit_name or ROOT_LABEL

    def rename(self, prefix: str) -> None:
        """Prefix every parameter name (the unit was adopted by an enclosing root)."""
        self.unit_name = f"{prefix}.{self.unit_name}" if self.unit_name else prefix
        self.layout = self.layout.with_prefix(prefix)

    # ------------------------------------------------------------ transitions
    @property
    def full_is_current(self) -> bool:
        return self._gathered_version == self.flat_shard._version

    def unshard(self) -> None:
        """Gather the full parameters (if stale) and show them on the module."""
        if self.state is ShardedState.UNSHARDED and self.full_is_current:
            return
        self.start_unshard()
        self._finish_gather()
        if not self.full_is_current:  # the shard changed after a prefetch was issued
            self.start_unshard()
            self._finish_gather()
        self._show(self.full_params)
        self.state = ShardedState.UNSHARDED

    def start_unshard(self) -> None:
        """Issue the all-gather of a stale copy without waiting (prefetch).

        :meth:`unshard` completes it; until then ``flat_full`` must not be read.
        """
        if self._gather_work is not None or self.full_is_current:
            return
        version = self.flat_shard._version
        if self.separate_full:
            self._allocate_full()
            shard = self._gather_source()
            self._gather_version_guard = torch.autograd._unsafe_preserve_version_counter(
                self.flat_full
            )
            with self._gather_version_guard:
                self._gather_work = self.shard_comm.all_gather(
                    self.flat_full, shard, purpose="params", unit=self.comm_label
                )
            self._gather_input = shard
        self._gather_version = version
        if self._gather_work is None:
            self._gathered_version = version

    def _finish_gather(self) -> None:
        if self._gather_work is None:
            return
        # The collective bumps flat_full's version whenever it lands (on gloo, on its own
        # thread): restore the version from before it was issued, see [Note: version counters].
        with self._gather_version_guard:
            self._gather_work.wait()
        if self._gather_staged is not None:  # [Note: asynchronous copies from pinned memory]
            self._gather_staged.wait_copied()
            self._gather_staged = None
        self._gather_work = None
        self._gather_input = None
        self._gathered_version = self._gather_version

    def _allocate_full(self) -> None:
        """Give ``flat_full`` its storage back if a reshard released it."""
        storage = self.flat_full.untyped_storage()
        needed = self.flat_full.numel() * self.flat_full.element_size()
        if storage.size() != needed:
            storage.resize_(needed)

    def _gather_source(self) -> torch.Tensor:
        """The all-gather's input: the shard in compute_dtype, on the compute device.

        Cast before gathering, so the collective moves compute_dtype bytes.
        """
        if self.host_staging is None:
            return self.flat_shard.detach().to(self.compute_dtype)
        self._gather_staged = self.host_staging.to_device(
            self.flat_shard.detach(), self.compute_device, self.compute_dtype
        )
        return self._gather_staged.tensor

    @property
    def gather_in_flight(self) -> bool:
        return self._gather_work is not None

    def accept_gathered(self, full_by_rank: torch.Tensor, *, version: int) -> None:
        """Take the gathered parameters from a fused all-gather ([Note: all-gather buckets]).

        ``full_by_rank``: ``(num_shards, shard_numel)``, rank r's shard in row r;
        ``version``: ``flat_shard._version`` when the shards were read.
        """
        self._allocate_full()
        # As for a plain all-gather: see [Note: version counters].
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat_full):
            self.flat_full.view(self.num_shards, -1).copy_(full_by_rank)
        self._gathered_version = version

    def adopt_gather(self, work: Any, *, version: int) -> None:
        """Make ``work``, a fused all-gather in flight that fills ``flat_full`` through
        :meth:`accept_gathered`, this unit's gather in flight ([Note: all-gather buckets]).
        """
        self._gather_work = work
        self._gather_version = version
        self._gather_version_guard = torch.autograd._unsafe_preserve_version_counter(self.flat_full)

    def reshard(self, *, free: bool) -> None:
        """Show the shard views; release the gathered storage when ``free``."""
        self._show(self.shard_params)
        self.state = ShardedState.SHARDED
        if free and self.separate_full:
            self._finish_gather()  # never release storage under an all-gather in flight
            self.flat_full.untyped_storage().resize_(0)
            self._gathered_version = None

    @property
    def full_storage_bytes(self) -> int:
        """Bytes currently held by the gathered buffer (0 once released)."""
        if not self.separate_full:
            return 0
        return self.flat_full.untyped_storage().size()

    # -------------------------------------------------------------- gradients
    def has_local_grads(self) -> bool:
        return any(p.grad is not None for p in self.full_params)

    def start_reduce_grads(self, scratch: ScratchPool | None = None) -> None:
        """Issue the gradient reduction without waiting; :meth:`finish_reduce_grads` ends it.

        Parameters without a local gradient contribute zeros; whether they get a gradient
        at all is decided by the presence vote (:meth:`assign_grads`).

        ``scratch``: where a sharded unit's flat gradient (the reduce-scatter's input) comes
        from; a new buffer when None.
        """
        if self.reduces_in_place:  # the all-reduce is the first (and only) stage
            flat_grad = self.take_local_grads(self._dp_grad_buffer())
            work = self.replicate_comm.all_reduce(flat_grad, purpose="grads", unit=self.comm_label)
            self._reductions.append(_Reduction(work, flat_grad, flat_grad, replicate_done=True))
            return
        out = None
        if scratch is not None:
            out = scratch.take(self.flat_grad_numel, self.reduce_dtype, self.compute_device)
        flat_grad = self.take_local_grads(out)
        reduced = torch.empty(
            self.layout.shard_numel, dtype=self.reduce_dtype, device=flat_grad.device
        )
        work = self.shard_comm.reduce_scatter(
            reduced, flat_grad, purpose="grads", unit=self.comm_label
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

    def take_local_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The local gradients as one flat, padded ``reduce_dtype`` tensor (full views cleared).

        ``out`` (1D, :attr:`flat_grad_numel` elements of ``reduce_dtype``): write them there.
        """
        if out is None:
            return self._flatten_local_grads().to(self.reduce_dtype)
        if out.dtype == self.flat_full.dtype:
            return self._flatten_local_grads(out)
        return out.copy_(self._flatten_local_grads())

    @property
    def flat_grad_numel(self) -> int:
        """Elements of the flat gradient :meth:`take_local_grads` returns (padded)."""
        return self.grad_slots.numel

    def accept_reduced(self, reduced: torch.Tensor, *, replicate_done: bool) -> None:
        """Finish a reduction of this rank's shard (1D, shard_numel): replicas, scale, add."""
        if self.replicate_comm is not None and not replicate_done:
            self.replicate_comm.all_reduce(reduced, purpose="grads", unit=self.comm_label).wait()
        reduced = reduced.to(self.dtype).div_(self.data_parallel_size)
        if self.host_staging is not None:  # the optimizer steps on the host
            reduced = self.host_staging.to_host(reduced)
        if self.pending_grad_shard is None:
            self.pending_grad_shard = reduced
        else:
            self.pending_grad_shard.add_(reduced)

    @property
    def reduce_in_flight(self) -> bool:
        return bool(self._reductions)

    def _flatten_local_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        flat_grad = out
        if flat_grad is None:
            flat_grad = self.flat_full.new_empty(self.grad_slots.numel)
        flatten_local_grads(flat_grad, self.grad_slots, self.full_params, self.local_grad_present)
        return flat_grad

    def assign_grads(self, global_present: list[bool]) -> None:
        """Move the pending reduced gradient onto the shard views that got one anywhere."""
        pending = self.pending_grad_shard
        self.pending_grad_shard = None
        self.local_grad_present = [False] * len(self.full_params)
        if pending is not None:
            piece_of = functools.partial(self._grad_piece, pending)
            assign_reduced(
                self.shard_params,
                piece_of,
                pending,
                global_present,
                pending_is_kept=self._pending_is_kept,
            )

    def _grad_piece(self, flat_grad_shard: torch.Tensor, index: int) -> torch.Tensor:
        # Parameter ``index``'s part of this rank's reduced flat gradient.
        if not self.reduces_in_place:
            return self.shard_view(flat_grad_shard, index)
        start, end = self.grad_slots.ranges[index]  # type: ignore[misc]  # trainable: a slot
        return flat_grad_shard[start:end].view(self.layout.params[index].shape)

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


def _check_uniform(unit_name: str, layout: FlatLayout, params: list[nn.Parameter]) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        what = ", ".join(f"{i.fqn}: {p.dtype}" for i, p in zip(layout.params, params, strict=True))
        raise ValueError(f"unit {unit_name!r}: parameters of mixed dtypes ({what})")


def holds_shards_of(optimizer: torch.optim.Optimizer, handles: list[FlatParamHandle]) -> bool:
    """Whether ``optimizer`` updates any shard view of ``handles``."""
    mine = {id(p) for h in handles for p in h.shard_params}
    return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
