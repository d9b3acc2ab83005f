"""``ShardedModule``: the FSDP-compatible entry point, the wrap policies it takes, and
``enable_wrap``/``wrap`` (where ``torch.distributed.fsdp.wrap`` has them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .assemble.compose import build_root
from .assemble.fsdp_units import FSDP1Attributes, FSDP1RootAttributes, FSDPMeta
from .assemble.nesting import check_not_wrapped
from .assemble.root import RootField, ShardRoot, is_root
from .assemble.sharding import resolve_ignored
from .assemble.unused_args import note_unused_args
from .assemble.wrap_options import WrapOptions
from .base.docstrings import doc_from
from .base.validate import check_bool
from .base.warn_once import warn_once
from .ckpt import fsdp1 as _fsdp1
from .ckpt import fsdp1_rekey
from .ckpt import state_dict as _state_dict
from .comm.collectives import CollectiveChecker
from .core.unit import Unit
from .features import batch_weight, forward_methods, fsdp1_methods, grad_clip, grad_sync, tuning
from .features import summon as full_params
from .options import BackwardPrefetch, CPUOffload
from .policies import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "ShardedModule",
    "ModuleWrapPolicy",
    "CustomPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "enable_wrap",
    "wrap",
]


class ShardedModule(FSDP1RootAttributes, FSDP1Attributes, nn.Module, metaclass=FSDPMeta):
    """Shard ``module``'s parameters, gradients and optimizer state across ranks.

    Arguments and their meaning follow ``torch.distributed.fsdp.FullyShardedDataParallel``.
    Parameter and state-dict names are exactly those of the unwrapped ``module``; the
    parameters the optimizer receives are this rank's pieces of the originals.

    ``comm_quantization`` (keyword only): ZeRO++'s switches, a ``CommQuantization``.
    ``device_mesh`` may be a slice of a bigger mesh (``mesh["dp"]``; ``mesh["replicate",
    "shard"]`` for hybrid), and ``module`` may hold ``DTensor`` parameters from torch's tensor
    parallelism: [Note: ZeRO over tensor-parallel parameters] in ``core/tensor_parallel.py``.

    ``param_persistence_threshold`` (keyword only; 0 = off): units whose parameters total
    fewer elements are kept whole and replicated on every rank, never all-gathered, their
    gradients all-reduced; see [Note: parameter persistence] in ``layout/persistence.py``.

    The constructor parses these arguments into ``WrapOptions`` and builds the model's
    ``ShardRoot`` (``assemble/compose.py``); :meth:`from_options` takes options another door
    parsed.
    """

    # isinstance(unit_module, ShardedModule) holds too: [Note: units as FSDP instances].
    _answers_for_units = True
    # FSDP1's attribute names (and shardwrap's own additions), read from the root.
    sharding_strategy = RootField(options=True)
    backward_prefetch = RootField(options=True)
    forward_prefetch = RootField(options=True)
    mixed_precision = RootField(options=True)
    cpu_offload = RootField(options=True)
    param_persistence_threshold = RootField(options=True)
    comm_ledger = RootField()
    disk_store = RootField()
    comm_quantization = RootField()

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: Any = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Any = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = True,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: Any = None,
        *,
        param_persistence_threshold: int = 0,
        comm_quantization: Any = None,
    ) -> None:
        super().__init__()
        check_not_wrapped(module)
        # Kept for FSDP's attribute names; what shardwrap does instead: [Note: FSDP1
        # arguments not acted on] in assemble/unused_args.py.
        self.limit_all_gathers = check_bool("limit_all_gathers", limit_all_gathers)
        self.use_orig_params = check_bool("use_orig_params", use_orig_params)
        note_unused_args(limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params)
        options = WrapOptions(
            sharding_strategy=sharding_strategy,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            param_persistence_threshold=param_persistence_threshold,
            comm_quantization=comm_quantization,
            auto_wrap_policy=auto_wrap_policy,
            ignored=resolve_ignored(ignored_modules, ignored_states, module),
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            process_group=process_group,
            device_mesh=device_mesh,
        )
        self._attach(module, options)

    @classmethod
    def from_options(cls, module: nn.Module, options: WrapOptions) -> ShardedModule:
        """Wrap ``module`` as ``options`` (parsed by another door) say; FSDP1's
        ``limit_all_gathers`` and ``use_orig_params`` keep their defaults."""
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper.limit_all_gathers = wrapper.use_orig_params = True
        wrapper._attach(module, options)
        return wrapper

    def _attach(self, module: nn.Module, options: WrapOptions) -> None:
        """Build ``module``'s root (which this object holds) and adopt ``module``."""
        self.register_load_state_dict_post_hook(ShardedModule._forget_inner_missing)
        self._root: ShardRoot = build_root(module, options, holder=self)
        self.module = module

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._root.begin_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no gradient communication) inside this context."""
        with self._root.runtime.no_sync():
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the full gradients' total norm to ``max_norm``; see :mod:`.grad_clip`."""
        runtime = self._root.runtime
        return grad_clip.clip_grad_norm_(runtime, self.parameters(), max_norm, norm_type)

    def batch_weight(self, local_count: int) -> float:
        """Loss factor for unequal per-rank batch sizes; see :mod:`.batch_weight`."""
        return batch_weight.batch_weight(self._root.runtime, local_count)

    # ------------------------------------------ microbatches and schedule tuning
    @doc_from(grad_sync.set_requires_gradient_sync)
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        grad_sync.set_requires_gradient_sync(self._root, requires_gradient_sync, recurse=recurse)

    @doc_from(grad_sync.set_reshard_after_backward)
    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        grad_sync.set_reshard_after_backward(self._root, reshard_after_backward, recurse=recurse)

    @doc_from(grad_sync.set_is_last_backward)
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        grad_sync.set_is_last_backward(self._root, is_last_backward)

    @property
    def requires_gradient_sync(self) -> bool:
        """What :meth:`set_requires_gradient_sync` (or ``no_sync``) set last."""
        return self._root.runtime.sync_grads

    @doc_from(tuning.set_reshard_after_forward)
    def set_reshard_after_forward(self, reshard: bool, *, root_only: bool = True) -> None:
        tuning.set_reshard_after_forward(self._root, reshard, root_only=root_only)

    @doc_from(tuning.set_reduce_bucket_size)
    def set_reduce_bucket_size(self, num_bytes: int) -> None:
        tuning.set_reduce_bucket_size(self._root, num_bytes)

    @doc_from(tuning.set_all_gather_bucket_size)
    def set_all_gather_bucket_size(self, num_bytes: int) -> None:
        tuning.set_all_gather_bucket_size(self._root, num_bytes)

    @doc_from(fsdp1_methods.register_comm_hook)
    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        fsdp1_methods.register_comm_hook(self._root, state, hook)

    summon_full_params = staticmethod(full_params.summon_full_params)
    register_forward_method = staticmethod(forward_methods.register_forward_method)

    # ------------------------------------------------------------------ debug
    def set_collective_checks(self, enabled: bool, *, timeout_s: float = 60.0) -> None:
        """Check before every collective that all ranks run the same one (see
        :class:`shardwrap.comm.collectives.CollectiveChecker`); a divergence raises on every rank
        instead of hanging. Costs one small object all-gather per collective."""
        checker = CollectiveChecker(timeout_s) if check_bool("enabled", enabled) else None
        for comm in self._root.communicators():
            comm.checker = checker

    @contextlib.contextmanager
    def checking_collectives(self, *, timeout_s: float = 60.0) -> Iterator[None]:
        """Context manager form of :meth:`set_collective_checks`."""
        self.set_collective_checks(True, timeout_s=timeout_s)
        try:
            yield
        finally:
            self.set_collective_checks(False)

    # ------------------------------------------------------------ introspection
    @property
    def units(self) -> list[Unit]:
        """The units in wrap order (the root module's unit first)."""
        return list(self._root.units)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[ShardedModule]:
        """Every FSDP instance in ``module``'s tree, roots and units, in module order
        (FSDP's name); only the roots when ``root_only``."""
        if root_only:
            return [m for m in module.modules() if is_root(m)]
        return [m for m in module.modules() if isinstance(m, ShardedModule)]

    def check_is_root(self) -> bool:
        return True

    # ---------------------------------------- names as in the unwrapped module
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars=False):
        """Under ``FULL_STATE_DICT`` (default): whole tensors, the unwrapped model's keys."""
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, prefix, keep_vars)[:3]
        if keep_vars:
            warn_once(
                "ShardedModule.state_dict(keep_vars=True)",
                "not acted on: the values are gathered or sharded copies, not the module's "
                "parameters (which are views of this rank's shard); they carry no autograd state",
            )
        return _state_dict.module_state_dict(self, destination=destination, prefix=prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported by ShardedModule")
        return _state_dict.load_module_state_dict(self, state_dict, strict=strict)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """Load our keys when a plain parent module's ``load_state_dict`` reaches us.

        The parent walks into ``self.module`` afterwards, under the extra ``module.`` prefix
        our keys do not have; ``_forget_inner_missing`` drops what that walk reports.
        """
        if local_metadata.get("assign_to_params_buffers"):
            raise ValueError("load_state_dict: assign=True is not supported by ShardedModule")
        ours = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = _state_dict.load_module_state_dict(self, ours, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
        self._inner_prefix = prefix + "module."

    @staticmethod
    def _forget_inner_missing(module: ShardedModule, incompatible_keys) -> None:
        inner = module.__dict__.pop("_inner_prefix", None)
        if inner is not None:
            missing = incompatible_keys.missing_keys
            missing[:] = [k for k in missing if not k.startswith(inner)]

    # FSDP1's static state-dict and optimizer-state API (see shardwrap/ckpt/fsdp1.py).
    state_dict_type = staticmethod(_fsdp1.state_dict_type)
    set_state_dict_type = staticmethod(_fsdp1.set_state_dict_type)
    get_state_dict_type = staticmethod(_fsdp1.get_state_dict_type)
    optim_state_dict = staticmethod(_fsdp1.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_fsdp1.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(_fsdp1.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_fsdp1.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_fsdp1.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_fsdp1.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_fsdp1.flatten_sharded_optim_state_dict)
    rekey_optim_state_dict = staticmethod(fsdp1_rekey.rekey_optim_state_dict)
    apply = fsdp1_methods.apply

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


FullyShardedDataParallel = ShardedModule


class _WrapContext(threading.local):
    def __init__(self) -> None:
        self.kwargs: dict[str, Any] | None = None


_wrap_context = _WrapContext()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable[..., nn.Module] | None = None, **wrapper_kwargs: Any):
    """Inside this context, :func:`wrap` turns modules into ``wrapper_cls`` units."""
    if wrapper_cls is None:
        wrapper_cls = ShardedModule
    previous = _wrap_context.kwargs
    _wrap_context.kwargs = {"wrapper_cls": wrapper_cls, **wrapper_kwargs}
    try:
        yield
    finally:
        _wrap_context.kwargs = previous


def wrap(module: nn.Module, **overrides: Any) -> nn.Module:
    """Wrap ``module`` with the enclosing :func:`enable_wrap`'s settings (else return it)."""
    if _wrap_context.kwargs is None:
        return module
    kwargs = {**_wrap_context.kwargs, **overrides}
    wrapper_cls = kwargs.pop("wrapper_cls")
    return wrapper_cls(module, **kwargs)
