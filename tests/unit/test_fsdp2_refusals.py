"""The FSDP2 door refuses what it does not support, by name, before touching any state.

Each case is an argument or method torch's FSDP2 accepts; shardwrap must raise an error
that names it (never drop it silently). Negative control: the default arguments pass
the same checks (``test_defaults_pass``), so the refusals are not a blanket failure.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

import shardwrap
from shardwrap.base.torch_compat import fsdp2_reduces_in_param_dtype_by_default
from shardwrap.comm import user_comms
from shardwrap.comm.user_comms import check_user_comm
from shardwrap.core.grad_division import split_divisor
from shardwrap.core.grads import checked_divide_factor
from shardwrap.core.replica_grads import ReplicaGrads
from shardwrap.fsdp2.fully_shard_args import check_offload_mesh, parse_options
from shardwrap.fsdp2.module import FSDPModule, _check_local_accumulation, as_fsdp_module
from shardwrap.fsdp2.replicas import set_hook
from shardwrap.options import CPUOffload, MixedPrecision

DEFAULTS = dict(
    reshard_after_forward=None,
    shard_placement_fn=None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params=None,
)


def test_defaults_pass():
    assert parse_options(**DEFAULTS).reshard_after_forward is None
    assert (
        parse_options(**{**DEFAULTS, "reshard_after_forward": False}).reshard_after_forward is False
    )


def test_mixed_precision_policies_become_the_engines_record():
    """Negative control of the fp16 refusals: fp16 compute reducing in fp32 passes."""
    bf16 = parse_options(**{**DEFAULTS, "mp_policy": MixedPrecisionPolicy(torch.bfloat16)})
    # reduce_dtype None: torch < 2.15's FSDP2 reduces in param_dtype, 2.15's in the
    # parameters' own dtype (float32 here).
    default_reduce = None if fsdp2_reduces_in_param_dtype_by_default() else torch.float32
    assert bf16.mixed_precision == MixedPrecision(
        param_dtype=torch.bfloat16,
        reduce_dtype=default_reduce,
        cast_forward_inputs=True,
        cast_root_forward_inputs=True,
        module_classes_to_ignore=(),
    )
    assert bf16.output_dtype is None
    policy = MixedPrecisionPolicy(torch.float16, torch.float32, torch.float32, False)
    fp16 = parse_options(**{**DEFAULTS, "mp_policy": policy})
    assert fp16.mixed_precision.reduce_dtype == torch.float32
    assert not fp16.mixed_precision.cast_forward_inputs
    assert not fp16.mixed_precision.cast_root_forward_inputs
    assert fp16.output_dtype == torch.float32
    only_output = MixedPrecisionPolicy(output_dtype=torch.bfloat16)
    assert parse_options(**{**DEFAULTS, "mp_policy": only_output}).mixed_precision is None
    assert parse_options(**DEFAULTS).mixed_precision is None


def test_each_calls_offload_policy_is_the_engines_cpu_offload():
    """CPUOffloadPolicy(pin_memory=False) is host shards, unpinned; OffloadPolicy() none;
    pin_memory=True needs CUDA (torch's FSDP2 fails pinning without it); a non-CPU mesh is
    refused. Negative control: the default policy leaves cpu_offload None."""
    unpinned = parse_options(**{**DEFAULTS, "offload_policy": CPUOffloadPolicy(pin_memory=False)})
    assert unpinned.cpu_offload == CPUOffload(offload_params=True, pin_memory=False)
    assert parse_options(**DEFAULTS).cpu_offload is None
    pinned = {**DEFAULTS, "offload_policy": CPUOffloadPolicy()}
    if torch.cuda.is_available():
        assert parse_options(**pinned).cpu_offload == CPUOffload(True, pin_memory=True)
    else:
        with pytest.raises(ValueError, match="pin_memory=False"):
            parse_options(**pinned)
    check_offload_mesh(unpinned, "cpu")
    check_offload_mesh(parse_options(**DEFAULTS), "cuda")
    with pytest.raises(ValueError, match="offload_policy.*'cuda' mesh"):
        check_offload_mesh(unpinned, "cuda")


def _runtime_with(compute_dtype, reduce_dtype):
    handle = SimpleNamespace(compute_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    return SimpleNamespace(units=[SimpleNamespace(name="blocks.0", handle=handle)])


def test_unsynced_accumulation_in_another_dtype_than_fsdp2s_is_refused():
    """FSDP2 accumulates unsynced gradients in reduce_dtype, the engine in param_dtype.
    Negative control: one dtype for both passes."""
    with pytest.raises(NotImplementedError, match="set_requires_gradient_sync.*blocks.0"):
        _check_local_accumulation(_runtime_with(torch.bfloat16, torch.float32))
    _check_local_accumulation(_runtime_with(torch.bfloat16, torch.bfloat16))


@pytest.mark.parametrize(
    ("argument", "value", "error"),
    [
        ("reshard_after_forward", "yes", TypeError),
        ("shard_placement_fn", lambda p: None, ValueError),
        ("mp_policy", MixedPrecisionPolicy(param_dtype=torch.int8), ValueError),
        ("mp_policy", MixedPrecisionPolicy(output_dtype=torch.int32), ValueError),
        ("mp_policy", "bf16", TypeError),
        ("offload_policy", CPUOffloadPolicy(pin_memory="yes"), TypeError),
        ("offload_policy", CPUOffload(offload_params=True), TypeError),
        ("ignored_params", {"weight"}, TypeError),
        ("ignored_params", nn.Parameter(torch.zeros(1)), TypeError),
    ],
)
def test_unsupported_arguments_are_refused_by_name(argument, value, error):
    with pytest.raises(error, match=argument):
        parse_options(**{**DEFAULTS, argument: value})


def test_a_list_with_a_non_module_is_refused_before_any_collective():
    with pytest.raises(TypeError, match="module"):
        shardwrap.fully_shard([nn.Linear(2, 2), "not a module"])


REFUSED = [
    name
    for name in vars(FSDPModule)
    if name.startswith(("set_", "reset_"))
    and name
    not in (
        "set_requires_gradient_sync",
        "set_reshard_after_backward",
        "set_is_last_backward",
        "set_reshard_after_forward",
        "set_gradient_divide_factor",
        "set_reduce_scatter_divide_factor",
        "set_force_sum_reduction_for_comms",
        "set_modules_to_forward_prefetch",
        "set_modules_to_backward_prefetch",
        "set_requires_all_reduce",
        "set_all_reduce_hook",
        "set_unshard_in_backward",
        "set_post_optim_event",
        "reset_iter_state",
        "set_manual_backward_finalization",
        "set_keep_unsharded_storage",
        "set_custom_all_gather",
        "set_custom_reduce_scatter",
    )
]


@pytest.mark.parametrize("name", REFUSED)
def test_unsupported_methods_say_why(name):
    module = nn.Linear(2, 2)
    as_fsdp_module(module)
    assert type(module).__name__ == "FSDPLinear" and isinstance(module, FSDPModule)
    with pytest.raises(NotImplementedError, match=f"FSDPModule.{name} is not yet supported"):
        getattr(module, name)(None)


def test_every_torch_fsdp_module_method_is_answered():
    """Each public method of torch's FSDPModule is provided or refused, none missing."""
    torch_names = {n for n in vars(torch.distributed.fsdp.FSDPModule) if not n.startswith("_")}
    ours = set(vars(FSDPModule))
    assert torch_names - ours == set()


@pytest.mark.parametrize(
    ("factor", "error"),
    [
        (0, ValueError),
        (-2.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("2", TypeError),
    ],
)
def test_a_gradient_divide_factor_must_be_a_positive_finite_number(factor, error):
    with pytest.raises(error, match="factor"):
        checked_divide_factor(factor)
    assert checked_divide_factor(2) == 2.0 and checked_divide_factor(1.0) == 1.0


def test_an_fp16_policy_without_reduce_dtype_follows_the_torch_release():
    """torch < 2.15 reduces it in fp16 (reduce_dtype None: the param_dtype's); 2.15 in the
    parameters' float32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    parsed = parse_options(**{**DEFAULTS, "mp_policy": policy})
    if fsdp2_reduces_in_param_dtype_by_default():
        assert parsed.mixed_precision.reduce_dtype is None
        assert parsed.mixed_precision.param_dtype == torch.float16
    else:
        assert parsed.mixed_precision.reduce_dtype == torch.float32


@pytest.mark.parametrize(
    ("factor", "split"),
    [
        (1, (1, 1)),
        (2, (2, 1)),
        (3, (2, 1.5)),
        (4, (2, 2)),
        (6, (4, 1.5)),
        (8, (4, 2)),
        (16, (4, 4)),
    ],
)
def test_float16_sums_are_divided_around_the_sum_as_fsdp2_divides_them(factor, split):
    """[Note: float16 reductions divided around the sum]: the two factors multiply to the
    divisor, the first a power of two about its square root (FSDP2's rule, worked by hand)."""
    assert split_divisor(factor) == split
    assert split[0] * split[1] == factor


class _Sized:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("factor", [None, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16])
def test_float16_division_follows_the_installed_torchs_rule(world, factor):
    """The same split as the installed torch's FSDP2 computes for a float16 reduction
    (its private ``_get_gradient_divide_factors``, in 2.13 to 2.15): a change of torch's
    rule fails here, not in a comparison of trained weights."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    before, after, *_ = _get_gradient_divide_factors(
        _Sized(world), None, torch.float16, factor=factor
    )
    assert split_divisor(float(world) if factor is None else factor) == (before, after)


def test_the_all_reduce_hooks_arguments_are_checked_by_name():
    """FSDP2's own ValueError for a stream under HSDP; on a 1-D mesh a stream is refused
    (the hook runs on the current stream). Negative control: a callable, no stream, passes."""
    module = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="hook: expected a callable"):
        set_hook(module, None, None, hsdp=True)
    with pytest.raises(ValueError, match="stream: cannot be set when using native HSDP"):
        set_hook(module, print, object(), hsdp=True)
    with pytest.raises(NotImplementedError, match=r"set_all_reduce_hook\(stream=...\)"):
        set_hook(module, print, object(), hsdp=False)
    set_hook(module, print, None, hsdp=True)  # no fully_shard state: no unit to set


@pytest.mark.parametrize("around", [True, False])
def test_a_float16_reduction_refuses_the_all_reduce_hook(monkeypatch, around):
    """FSDP2 calls the hook between its two divisions of a float16 sum; shardwrap divides
    both before the hook, so the hook is refused there, by name. Control: the same unit
    dividing once (``around`` False) takes the hook."""
    import shardwrap.fsdp2.replicas as replicas_module

    grads = types.SimpleNamespace(
        reduce_dtype=torch.float16,
        dtype=torch.float16,
        divides_around_reduction=around,
        comm_label="blocks.0",
        replicas=ReplicaGrads(),
    )
    monkeypatch.setattr(replicas_module, "_unit_grads", lambda modules: [grads])
    if around:
        with pytest.raises(NotImplementedError, match="'blocks.0': it reduces in float16"):
            set_hook(nn.Linear(2, 2), print, None, hsdp=True)
        assert grads.replicas.hook is None
    else:
        set_hook(nn.Linear(2, 2), print, None, hsdp=True)
        assert grads.replicas.hook is print


def test_a_skipped_all_reduce_keeps_the_sum_and_its_presence_flags():
    """[Note: the replica all-reduce skipped]: kept outputs add up, in place, and join the
    next all-reduce's input; the flags of a backward that assigned nothing join the next
    assignment's. Negative control: nothing kept, the flags pass through unchanged."""
    replicas = ReplicaGrads()
    assert replicas.presence([True, False], waits=True) == [True, False]
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])
    replicas.keep(first)
    replicas.keep(second)
    assert replicas.presence([False, True], waits=True) is None  # waits with the sum
    reduced = torch.tensor([4.0, 8.0])
    replicas.add_kept(reduced)
    assert torch.equal(reduced, torch.tensor([5.5, 10.25])) and replicas.kept is None
    assert replicas.presence([False, False], waits=False) == [False, True]


@pytest.mark.parametrize(("sees_sum", "expected"), [(False, [2.5]), (True, [1.0])])
def test_the_hook_runs_on_the_quotient_unless_the_comms_only_sum(sees_sum, expected):
    """[Note: the all-reduce hook]: after the division by default, before it under
    set_force_sum_reduction_for_comms(True); each case is the other's negative control."""
    replicas = ReplicaGrads()
    replicas.hook = lambda reduced: reduced.add_(2.0)
    replicas.hook_sees_sum = sees_sum
    assert replicas.divide(torch.tensor([2.0]), 4.0).tolist() == expected


class _Comm:
    """FSDP2's comm protocol, with ``allocate`` returning what the test gives it."""

    def __init__(self, buffer: object) -> None:
        self.buffer = buffer

    def allocate(self, size, *, dtype, device):
        return self.buffer

    def __call__(self, **kwargs):
        return None


@pytest.mark.parametrize("comm", [None, 3, print, SimpleNamespace(allocate=print)])
def test_a_communicator_without_the_protocol_is_a_type_error_naming_comm(comm):
    """Negative control: an object with ``allocate`` and ``__call__`` passes."""
    with pytest.raises(TypeError, match="comm: expected a communicator object"):
        check_user_comm("comm", comm)
    good = _Comm(torch.empty(4))
    assert check_user_comm("comm", good) is good


@pytest.mark.parametrize(
    ("buffer", "says"),
    [
        (None, "expected a tensor of 4 elements, got NoneType"),
        (torch.empty(3), "expected a tensor of 4 elements"),
        (torch.empty(4, dtype=torch.float64), "expected torch.float32 on cpu"),
    ],
)
def test_what_allocate_returns_is_checked_by_name(buffer, says):
    """Negative control: a right buffer (4 elements, float32, CPU; any shape) is used."""
    with pytest.raises(TypeError, match=f"_Comm.allocate: {says}"):
        user_comms.allocate(_Comm(buffer), 4, torch.float32, torch.device("cpu"))
    right = torch.empty(2, 2)
    used = user_comms.allocate(_Comm(right), 4, torch.float32, torch.device("cpu"))
    assert used.shape == (4,) and used.data_ptr() == right.data_ptr()


def test_a_refused_adoption_leaves_a_meta_model_as_it_was(one_rank):
    """Adopting a root set to finalize manually is refused before the call changes
    anything: the model's own parameters are still on the meta device, unsharded.
    (Control, run once: with the check back after materialize_meta, ``norm.weight`` had
    CPU storage after the refusal.)"""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    shardwrap.fully_shard(model[0])
    model[0].set_manual_backward_finalization(True)
    with pytest.raises(RuntimeError, match="must be called on the root FSDP module"):
        shardwrap.fully_shard(model)
    assert model[1].weight.is_meta and type(model) is nn.Sequential


def test_a_user_object_returning_neither_none_nor_work_is_refused_at_once():
    from shardwrap.comm.collectives import Communicator
    from shardwrap.comm.ledger import CommLedger

    class ReturnsATensor:
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, **kwargs):
            return torch.zeros(1)

    group = Communicator(None, CommLedger())
    with pytest.raises(TypeError, match=r"ReturnsATensor \(all_gather\) returned a Tensor"):
        user_comms.gather_params(group, ReturnsATensor(), torch.zeros(2), 2, unit="u")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 16)
        self.out = nn.Linear(16, 17, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


@pytest.mark.parametrize("on_meta", [False, True])
def test_a_weight_tied_across_two_calls_is_refused_as_torch_refuses_it(one_rank, on_meta):
    """[Note: a parameter shared by two calls]: refused at the second call, which changes
    nothing; torch's FSDP2 refuses the same model at its first forward (the reference).
    In one call the tie holds. Control (run once, the check removed): the second call was
    accepted, and the two copies trained apart (the torch_suite row)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    reference = _Tied()
    torch_fully_shard(reference.emb)
    torch_fully_shard(reference.out)
    torch_fully_shard(reference)
    with pytest.raises(ValueError, match="already managed by another"):
        reference(torch.zeros(1, 2, dtype=torch.long))
    with torch.device("meta" if on_meta else "cpu"):
        model = _Tied()
    shardwrap.fully_shard(model.emb)
    with pytest.raises(
        ValueError, match=r"parameter 'Linear.weight' is shared with .*\(unit 'Embedding'\)"
    ):
        shardwrap.fully_shard(model.out)
    assert type(model.out) is nn.Linear and model.out.weight.is_meta == on_meta
    together = _Tied()
    shardwrap.fully_shard([together.emb, together.out])
    shardwrap.fully_shard(together)
    assert together.out.weight is together.emb.weight


def test_an_unnamed_2d_mesh_is_refused_as_torch_refuses_it(one_rank):
    """torch's FSDP2 requires a 2-D (HSDP) mesh's dimensions named (its AssertionError,
    the reference here); the door refused nothing and took it as (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (1, 1))
    with pytest.raises(AssertionError, match="mesh_dim_names"):
        torch_fully_shard(nn.Linear(2, 2), mesh=mesh)
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"mesh: the 2-D mesh .* has no mesh_dim_names"):
        shardwrap.fully_shard(module, mesh=mesh)
    assert type(module) is nn.Linear
