"""Every unit is an FSDP instance to whoever looks, as FSDP1's wrappers are (one rank).

What torch's own FSDP tests check about wrapping structure: ``isinstance`` on each unit,
``FSDP.fsdp_modules`` listing the root and every unit, hand-nested units staying FSDP
instances after the root is wrapped, and a policy refused over already-wrapped modules;
while names, forward and state-dict keys stay exactly the unwrapped model's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwrap import FullyShardedDataParallel as FSDP
from shardwrap.wrap import ModuleWrapPolicy
from tests import models


def test_auto_wrapped_units_are_fsdp_instances(one_rank):
    reference = models.TinyGPT()
    plain = models.TinyGPT()
    plain.load_state_dict(reference.state_dict())
    model = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    blocks = list(plain.blocks)
    assert all(isinstance(b, FSDP) and isinstance(b, models.Block) for b in blocks)
    assert all(issubclass(type(b), FSDP) for b in blocks)
    assert not isinstance(plain.ln_f, FSDP) and not isinstance(plain, FSDP)
    assert [type(b).__name__ for b in blocks] == ["Block", "Block"]  # same name, repr
    assert FSDP.fsdp_modules(model) == [model, *blocks]
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not any(b.check_is_root() for b in blocks)
    # nothing else changed: names, keys, forward
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert list(model.state_dict()) == list(reference.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)


def test_hand_nested_unit_stays_an_fsdp_instance(one_rank):
    reference = models.MLP()
    plain = models.MLP()
    plain.load_state_dict(reference.state_dict())
    plain.body[2] = FSDP(plain.body[2])
    model = FSDP(plain)
    inner = plain.body[2]
    assert isinstance(inner, nn.Linear) and isinstance(inner, FSDP)
    assert FSDP.fsdp_modules(model) == [model, inner]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    x = torch.randn(3, 12)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="wrapped twice"):
        FSDP(inner)


def test_a_policy_over_already_wrapped_modules_is_refused(one_rank):
    plain = models.MLP()
    plain.body[0] = FSDP(plain.body[0])
    with pytest.raises(ValueError, match=r"auto_wrap_policy: submodule 'body.0' is already"):
        FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def test_fsdp1_attributes_frameworks_read(one_rank):
    # accelerate's mixed-precision pass: _has_params, _flat_param (dtype, device,
    # requires_grad, _fqns), _handle._orig_param_dtype
    plain = models.TinyGPT()
    model = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    for block in FSDP.fsdp_modules(model)[1:]:
        assert block._has_params
        flat = block._flat_param
        assert flat.dtype == torch.float32 and flat.device.type == "cpu"
        assert flat.requires_grad
        assert flat._fqns[0].startswith("blocks.") and len(flat._fqns) == len(
            list(block.parameters())
        )
        assert flat.numel() == sum(p.numel() for p in block.parameters())  # one rank
        block._handle._orig_param_dtype = torch.float32  # what it already is: accepted
        with pytest.raises(TypeError, match="cannot replace a unit's flat shard"):
            flat.data = flat.data.to(torch.bfloat16)
        with pytest.raises(TypeError, match="cannot change them to torch.bfloat16"):
            block._handle._orig_param_dtype = torch.bfloat16


def test_installed_get_state_dict_refuses_what_it_cannot_honour(one_rank):
    # torch's submodules= would restrict the state dict; dropping it would save it whole.
    from torch.distributed.checkpoint import state_dict as torch_dsd

    import shardwrap

    model = FSDP(models.MLP())
    shardwrap.install()
    try:
        with pytest.raises(ValueError, match="get_state_dict: submodules="):
            torch_dsd.get_state_dict(model, [], submodules={model.module.body})
    finally:
        shardwrap.uninstall()


_FIRST_INSTALL = """
import sys
assert "torch.distributed._composable.fsdp" not in sys.modules, "imported already"
import shardwrap
from torch.distributed.fsdp import _fully_shard as impl
shardwrap.install()
import torch.distributed._composable.fsdp as composable
assert composable.FSDPModule is shardwrap.FSDPModule
shardwrap.uninstall()
print(composable.FSDPModule is impl.FSDPModule, composable.fully_shard is impl.fully_shard)
"""


def test_uninstall_gives_back_torch_names_a_module_first_imported_by_install_held():
    """A fresh interpreter where torch's ``_composable.fsdp`` is first imported by
    ``install()``: it binds ``torch.distributed.fsdp``'s names at its import, so install()
    took shardwrap's (already rebound there) for torch's originals, and uninstall() left
    them in place: torch's own FSDP2 run after it in the same process averaged gradients
    under torchtitan (its isinstance check saw shardwrap's class). Control (run once, the
    old install()): "False False"."""
    import subprocess
    import sys

    found = subprocess.run(
        [sys.executable, "-c", _FIRST_INSTALL], capture_output=True, text=True, check=True
    )
    assert found.stdout.split() == ["True", "True"], found


def test_root_has_fsdp1_group_rank_and_size_units_keep_their_own(one_rank):
    """FSDP1's ``process_group``, ``rank`` and ``world_size`` on the root wrapper (torch's
    wrap tests read them); a unit module's own attributes of those names stay its own."""
    plain = models.TinyGPT()
    plain.blocks[0].process_group = "the block's own"
    group = torch.distributed.new_group([0])
    model = FSDP(plain, process_group=group, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    assert model.process_group is group
    assert (model.rank, model.world_size) == (0, 1)
    assert plain.blocks[0].process_group == "the block's own"
    assert not hasattr(plain.blocks[1], "world_size")
    default = FSDP(models.TinyGPT())
    assert default.process_group is torch.distributed.group.WORLD


def test_root_indexes_its_sequential_and_units_refuse_clipping(one_rank):
    """FSDP1 forwards ``model[i]`` to a wrapped ``nn.Sequential`` and refuses
    ``clip_grad_norm_`` on a non-root instance (torch's wrap and clipping tests rely on
    both); a unit's own method of that name would stay its own (its class comes first)."""
    seq = nn.Sequential(nn.Linear(4, 4), models.Block(32, 4))
    model = FSDP(seq, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    assert model[0] is seq[0] and model[1] is seq[1] and isinstance(model[1], FSDP)
    with pytest.raises(RuntimeError, match="should only be called on the root FSDP instance"):
        seq[1].clip_grad_norm_(1.0)

    class ClipsItself(nn.Linear):
        def clip_grad_norm_(self, max_norm: float) -> str:
            return "its own"

    outer = nn.Sequential(ClipsItself(4, 4), nn.Linear(4, 4))
    FSDP(outer, auto_wrap_policy=ModuleWrapPolicy({ClipsItself}))
    assert isinstance(outer[0], FSDP) and outer[0].clip_grad_norm_(1.0) == "its own"
