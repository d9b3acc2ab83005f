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

from tests import models, tolerances
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


# ------------------------------------------------ negative controls: bugs exceed each bound
CONTROL_FACTORS = {"doubled": 2.0, "zeroed": 0.0}  # every gradient of every step


def _control_run(model: str, optimizer: str, parts: int, grad_factor: float) -> dict:
    """``PARITY_STEPS`` steps of parity's ``model`` and ``optimizer`` on two ranks' batches
    summed in ``parts``, each gradient times ``grad_factor``: the losses (as computed), the
    gradients' L1 sums and 2-norms per step, and the final trainable parameters."""
    net = parity.build_model(model)
    optim = parity.make_optimizer(net, optimizer)
    run: dict = {"losses": [], "grad_l1s": [], "norms": []}
    for step in range(PARITY_STEPS):
        batch = parity.concat([parity.batch_for(model, 1000 * step + r) for r in range(2)])
        loss = 0.0
        for piece in zip(*(t.chunk(parts) for t in batch), strict=True):
            part = parity.loss_for(model, net, piece, step) / parts
            (grad_factor * part).backward()
            loss += float(part.detach())
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        run["losses"].append(loss)
        run["grad_l1s"].append(sum(float(g.abs().sum()) for g in grads))
        run["norms"].append(
            float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
        )
        optim.step()
        optim.zero_grad()
    run["params"] = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    return run


def _param_excess(run: dict, reference: dict, tol: dict) -> float:
    """The largest parameter difference in units of what ``tol`` allows there (> 1: fails)."""
    worst = 0.0
    for name, value in run["params"].items():
        want = reference["params"][name]
        allowed = tol["atol"] + tol["rtol"] * want.abs()
        worst = max(worst, float(((value - want).abs() / allowed).max()))
    return worst


def _loss_excess(run: dict, reference: dict, atols: list[float]) -> float:
    return max(
        abs(a - b) / atol
        for a, b, atol in zip(run["losses"], reference["losses"], atols, strict=True)
    )


# The bounds each bug must exceed. AdamW normalises the gradient: doubled, its updates
# move only where |g| is near eps, so the loss stays within its (AdamW) bound, measured
# 0.07-0.1 of it; the parameters still leave theirs.
MUST_EXCEED = {
    ("sgd", "doubled"): ("params", "losses", "norm"),
    ("sgd", "zeroed"): ("params", "losses", "norm"),
    ("adamw", "doubled"): ("params", "norm"),
    ("adamw", "zeroed"): ("params", "losses", "norm"),
}


@pytest.mark.parametrize("model,optimizer", PARITY_RUNS)
def test_doubled_or_zeroed_gradients_exceed_every_bound(model, optimizer):
    """The reordered run (halves accumulated) stays within parity's parameter bound
    (``reordered_tol``), the loss bound (``tolerances.reordered_loss_atols``) and the
    gradient-norm bound (``reordered_norm_atol``); the same steps with every gradient
    doubled or zeroed exceed them (``MUST_EXCEED``), so a bound loose enough to pass such a
    bug fails here. Measured, in units of the bound (TinyGPT / MLP): SGD doubled, params
    5.5e4 / 3.7e4, losses 2.6e3 / 4.1e3, step-0 norm 4.5e4 / 8.2e4; SGD zeroed, 5.7e4 /
    6.2e4, 2.3e3 / 5.2e3, the same norms; AdamW zeroed, params 17.8 / 17.5, losses 7.0 /
    10.0; AdamW doubled, params 7.2 / 3.3 (losses 0.1 / 0.07, not asserted)."""
    terms = parity.batch_terms(model, 2)
    relative = parity.reordered_relative(terms)
    tol = parity.reordered_tol(optimizer, PARITY_STEPS, terms)
    reference = _control_run(model, optimizer, 1, 1.0)
    largest = max(float(p.abs().max()) for p in reference["params"].values())
    loss_atols = tolerances.reordered_loss_atols(
        reference["losses"], reference["grad_l1s"], largest,
        lambda steps: parity.reordered_tol(optimizer, steps, terms), relative,
    )  # fmt: skip
    numel = parity.trainable_numel(parity.build_model(model))
    norm0 = reference["norms"][0]
    norm_atol = tolerances.reordered_norm_atol(
        2.0, numel, norm0, relative, parity.PARITY_GRAD_SCALE
    )

    def margins(run: dict) -> dict[str, float]:
        return {
            "params": _param_excess(run, reference, tol),
            "losses": _loss_excess(run, reference, loss_atols),
            "norm": abs(run["norms"][0] - norm0) / norm_atol,
        }

    reordered = margins(_control_run(model, optimizer, 2, 1.0))
    assert max(reordered.values()) <= 1.0, reordered
    for bug, factor in CONTROL_FACTORS.items():
        broken = margins(_control_run(model, optimizer, 2, factor))
        for bound in MUST_EXCEED[optimizer, bug]:
            assert broken[bound] > 1.0, (bug, bound, broken)


def test_forward_bound_holds_for_other_blocking_and_not_for_a_wrong_weight():
    """``reordered_forward_atol`` on the MLP: row by row (matrix-vector kernels) against
    the whole batch (matrix-matrix) stays within it; the same MLP with one weight row
    copied from the next (a bug in a load) exceeds it. Measured: bound 7.0e-5, rows 4.5e-8
    apart, the wrong row 4.4e-2."""
    torch.manual_seed(3)
    mlp = models.MLP()
    x = torch.randn(64, 12)
    atol = tolerances.reordered_forward_atol(mlp, x)
    with torch.no_grad():
        whole = mlp(x)
        rows = torch.cat([mlp(x[i : i + 1]) for i in range(x.shape[0])])
        torch.testing.assert_close(rows, whole, rtol=0.0, atol=atol)
        mlp.body[2].weight[0] = mlp.body[2].weight[1]
        assert float((mlp(x) - whole).abs().max()) > atol


def test_forward_bound_refuses_layers_it_does_not_bound():
    with pytest.raises(TypeError, match="no bound"):
        tolerances.magnitude_model(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU()))
