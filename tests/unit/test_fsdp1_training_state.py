"""FSDP1's ``training_state`` and ``_assert_state`` (one rank), as torch's FSDP1 answers them.

torch's own FSDP1 test utilities call ``model._assert_state(TrainingState.IDLE)`` after
each training loop, and ``apply()`` inside ``summon_full_params`` must raise the
``ValueError`` FSDP1 raises ("expected to be in states"). The states are torch's enum
members, read at each moment of a step: the root and each unit, in forward (a hook inside
a block), in backward (a gradient hook inside a block), between forward and backward, in a
summon and after the step.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._common_utils import TrainingState

from shardwrap import FullyShardedDataParallel as FSDP
from shardwrap.wrap import ModuleWrapPolicy
from tests import models


def _wrapped():
    plain = models.TinyGPT()
    return FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({models.Block})), plain


def test_states_through_a_step(one_rank):
    model, plain = _wrapped()
    block = plain.blocks[1]
    seen: dict[str, tuple] = {}

    def in_forward(_module, _args, output):
        seen["forward"] = (
            model.training_state,
            block.training_state,
            plain.blocks[0].training_state,
        )
        output.register_hook(in_backward)

    def in_backward(_grad):
        seen["backward"] = (model.training_state, block.training_state)

    block.fc.register_forward_hook(in_forward)
    assert model.training_state is TrainingState.IDLE and block.training_state is TrainingState.IDLE
    loss = models.gpt_loss(model, models.gpt_batch(0))
    # FSDP1: the forward is over, backward not begun: every instance idle.
    assert (model.training_state, block.training_state) == (TrainingState.IDLE,) * 2
    loss.backward()
    fb = TrainingState.FORWARD_BACKWARD
    # In block 1's forward, block 0's forward is over (IDLE) and the root's is not.
    assert seen["forward"] == (fb, fb, TrainingState.IDLE)
    assert seen["backward"] == (fb, fb)
    assert (model.training_state, block.training_state) == (TrainingState.IDLE,) * 2
    model._assert_state(TrainingState.IDLE)
    model._assert_state([TrainingState.FORWARD_BACKWARD, TrainingState.IDLE])
    with pytest.raises(ValueError, match="expected to be in states"):
        block._assert_state(TrainingState.FORWARD_BACKWARD)


def test_apply_inside_summon_is_refused(one_rank):
    model, plain = _wrapped()

    def fill(module):
        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.fill_(1.0)

    with FSDP.summon_full_params(model):
        summoned = TrainingState.SUMMON_FULL_PARAMS
        assert model.training_state is summoned and plain.blocks[0].training_state is summoned
        with pytest.raises(ValueError, match="expected to be in states"):
            model.apply(fill)
    # a summon of one unit marks that unit only
    with FSDP.summon_full_params(plain.blocks[0], recurse=False):
        assert plain.blocks[0].training_state is TrainingState.SUMMON_FULL_PARAMS
        assert plain.blocks[1].training_state is TrainingState.IDLE
    assert model.training_state is TrainingState.IDLE
    model.apply(fill)  # idle again: applied, and written back
    with FSDP.summon_full_params(model):
        assert bool((plain.blocks[1].fc.weight == 1.0).all())


def test_a_units_own_training_state_attribute_stays_its_own(one_rank):
    """A module that keeps an attribute named ``training_state`` reads and writes it as
    before wrapping (FSDP1 wraps it and leaves it alone); only the root answers FSDP1's."""

    class Phased(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.training_state = "warmup"

        def forward(self, x):
            self.training_state = "running"
            return super().forward(x)

    outer = torch.nn.Sequential(Phased(), torch.nn.Linear(4, 4))
    model = FSDP(outer, auto_wrap_policy=ModuleWrapPolicy({Phased}))
    assert isinstance(outer[0], FSDP) and outer[0].training_state == "warmup"
    model(torch.randn(2, 4)).sum().backward()
    assert outer[0].training_state == "running"
    assert model.training_state is TrainingState.IDLE
