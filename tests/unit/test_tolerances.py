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
from tests.dist import parity
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


PARITY_RUNS = [(model, optimizer) for model in ("gpt", "mlp") for optimizer in ("adamw", "sgd")]
PARITY_STEPS = 3  # tests/dist/parity.Case's default


@pytest.mark.parametrize("model,optimizer", PARITY_RUNS)
def test_parity_models_stay_within_their_bound_and_under_the_gradient_scale(model, optimizer):
    """tests/dist/parity's models and optimizers: whole batch against halves accumulated
    (two ranks' order), within ``parity.reordered_tol``,
    gradients under ``parity.PARITY_GRAD_SCALE``,
    and every trainable tensor moved by more than ``POWER`` bounds."""
    tol = parity.reordered_tol(optimizer, PARITY_STEPS, parity.batch_terms(model, 2))
    runs = []
    for parts in (1, 2):
        net = parity.build_model(model)
        optim = parity.make_optimizer(net, optimizer)
        largest = 0.0
        for step in range(PARITY_STEPS):
            batch = parity.concat([parity.batch_for(model, 1000 * step + r) for r in range(2)])
            for piece in zip(*(t.chunk(parts) for t in batch), strict=True):
                (parity.loss_for(model, net, piece, step) / parts).backward()
            largest = max(
                largest,
                max(float(p.grad.abs().max()) for p in net.parameters() if p.grad is not None),
            )
            optim.step()
            optim.zero_grad()
        runs.append((net, largest))
    (whole, largest), (halves, _) = runs
    assert largest < parity.PARITY_GRAD_SCALE
    initial = dict(parity.build_model(model).named_parameters())
    for (name, value), (_, other) in zip(
        whole.named_parameters(), halves.named_parameters(), strict=True
    ):
        torch.testing.assert_close(other, value, msg=name, **tol)
        if value.requires_grad:
            moved = float((value.detach() - initial[name].detach()).abs().max())
            assert moved > POWER * tol["atol"], (name, moved, tol["atol"])


def test_the_bound_needs_few_steps():
    with pytest.raises(ValueError, match="num_steps"):
        tolerances.reordered_param_atol(tolerances.ADAMW_MAX_STEPS + 1)
