"""The tolerances of tests/tolerances.py against what they bound, in one process.

Each model that a tensor-, pipeline- or 3-D-parallel test compares with single-process
training is trained twice here with the tests' AdamW: on the global batch, and on its
halves with the gradients accumulated (another order of the same sums, as a data-parallel
split makes). The two must stay within the bound, the gradients under ``GRAD_SCALE``, and
every parameter tensor must move by several times the bound, so that a tensor whose
gradient went missing or wrong would fail the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import tolerances
from tests.dist import pipeline_cases as pc
from tests.dist import threed_cases as tc
from tests.dist import threed_hf_cases as hc
from tests.dist import tp_cases as tp

MODELS = {
    "threed": (tc.whole_model, lambda s: tc.global_batch(s), tc.NUM_STEPS, F.mse_loss),
    "pipeline": (pc.whole_model, lambda s: pc.global_batch(s, 2), pc.NUM_STEPS, F.mse_loss),
    "tp": (tp.build_reference, tp.global_batch, tp.NUM_STEPS, None),
    "llama": (hc.whole_model, lambda s: hc.global_batch(s, 2), hc.NUM_STEPS, None),
}
POWER = 5  # each tensor moves by at least this many bounds


def _loss(name: str, model, x, y) -> torch.Tensor:
    if name == "tp":
        return tp.loss_of(model, x, y)
    if name == "llama":
        return hc.loss_fn(model(input_ids=x).logits, y)
    return MODELS[name][3](model(x), y)


def _train(name: str, parts: int) -> tuple[dict, float]:
    build, batch, num_steps, _ = MODELS[name]
    model = build()
    optim = torch.optim.AdamW(model.parameters(), **tolerances.REORDER_SAFE_ADAMW)
    largest = 0.0
    for step in range(num_steps):
        x, y = batch(step)
        for xs, ys in zip(x.chunk(parts), y.chunk(parts), strict=True):
            (_loss(name, model, xs, ys) / parts).backward()
        largest = max(largest, max(float(p.grad.abs().max()) for p in model.parameters()))
        optim.step()
        optim.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, largest


@pytest.mark.parametrize("name", MODELS)
def test_reordered_training_stays_within_the_bound_that_still_sees_every_tensor(name):
    build, _, num_steps, _ = MODELS[name]
    bound = tolerances.reordered_param_atol(num_steps)
    whole, largest = _train(name, 1)
    halves, _ = _train(name, 2)
    assert largest < tolerances.GRAD_SCALE
    initial = build().state_dict()
    for key, value in whole.items():
        torch.testing.assert_close(halves[key], value, rtol=0.0, atol=bound, msg=key)
        moved = float((value - initial[key]).abs().max())
        assert moved > POWER * bound, (key, moved, bound)


def test_the_bound_needs_few_steps():
    with pytest.raises(ValueError, match="num_steps"):
        tolerances.reordered_param_atol(tolerances.ADAMW_MAX_STEPS + 1)
