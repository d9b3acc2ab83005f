"""Named tolerances for float32 results whose sums ran in another order than the reference's.

[Note: tolerances from bounds]
A sharded run is compared bit for bit with its reference wherever both form the same sums
in the same order (one rank, checkpoint round trips). Where they cannot (a tensor-parallel
split sums each half of a matmul's inner dimension apart and then adds the halves; a
data-parallel split or microbatches sum the batch in parts; another CPU's kernels, AVX-512,
AVX2 or ATen's default ones, block the same sum differently), the two runs differ by
rounding, and the tolerance is one of these, derived from a bound on that rounding and
never tuned on one CPU.

Rounding. A k-term float32 sum is within k*u*sum|terms| of the exact one (u = 2**-24,
Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1), and within
about sqrt(k)*u*sum|terms| with high probability, the errors being independent (Higham and
Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.,
2019). A value that is a chain of D such sums deep, each of at most K terms, thus differs
between two orders by a relative REORDERED_RELATIVE = 2*sqrt(D*K)*u of the scale of its
terms (twice: each run is off the exact value on its own).

AdamW amplifies it. Its update of one element, lr * m/(sqrt(v) + eps), normalises the
gradient: at a gradient near 0 a difference d in the gradient moves the update by up to
lr*d/eps. With torch's default eps = 1e-8 that is 1e6*d, no bound worth the name: on an
AMD AVX2-only machine three elements of a tiny Llama's gate projection came out 1.28e-5
apart after 3 steps, from gradients that differed in their last bits. So every test that
compares AdamW training against a reordered reference runs AdamW with eps = ADAMW_EPS
(:data:`REORDER_SAFE_ADAMW`), where the update is Lipschitz in the gradients: for step
t <= 5 at betas (0.9, 0.999), sum_s |d u_t / d g_s| <= (1 + sqrt(t * sum_s w_s**2 / z_s))
* lr/eps <= ADAMW_LIPSCHITZ * lr/eps, w_s and z_s the bias-corrected weights of g_s in m
and v (sum_s w_s**2/z_s <= 1.02 there). Weight decay multiplies both runs' parameters by
the same factor and only shrinks their difference; the feedback of a parameter difference
into later gradients is second order in these sizes and steps. Hence
:func:`reordered_param_atol`.

SGD with momentum m (dampening 0) does not normalise: after T steps a parameter is
p_0 - lr * sum_{t<=T} sum_{s<=t} m**(t-s) * g_s, so gradients apart by d move it apart by at
most lr * d * sum_{t<=T} (1 + m + ... + m**(t-1)). Coupled weight decay wd adds wd * p to
each gradient, feeding a parameter difference B back as lr * wd * B times the same weight,
hence the factor 1 / (1 - lr * wd * weight) of :func:`reordered_sgd_param_atol`.

A loss compared after the parameters drifted by at most B per element differs, to first
order, by at most |grad L|_1 * B (the gradient's sum of magnitudes), on top of its own
rounding: :func:`reordered_loss_atol`.

:func:`reordered_relative` gives the relative bound for other depths and sum lengths (the
parity tests' TinyGPT: tests/dist/parity.py); the functions below take it as ``relative``.
Losses after steps take the drift of the steps before them (:func:`reordered_loss_atols`);
gradients clipped by a norm summed in another order, :func:`clipped_grad_multiple`; bf16
and fp16 compute, :func:`low_precision_relative`; a handful of terms added in two orders,
:func:`short_sum_relative`; Python float formulas, :func:`float64_formula_rtol`; a forward
pass of Linear layers on other kernels, [Note: forward bound]. tests/unit/test_tolerances.py
shows that doubled or zeroed gradients exceed the parameter, loss and norm bounds.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

FP32_UNIT_ROUNDOFF = 2.0**-24
# The longest sum in the models of these tests: tokens per weight gradient (64 in the
# 3-D Llama's global batch), a matmul's inner dimension (at most 64).
SUM_TERMS = 64
# Sums chained between a parameter and the loss, forward and backward, in the deepest of
# these models, the 3-D Llama: 4 layers of about 9 (norm, q/k/v, scores, softmax, values,
# output, norm, gate/up, down) each way, the final norm, head and loss: at most 80.
CHAIN_DEPTH = 80
# The scale of a gradient's terms: above the largest gradient element these models see
# (0.2 to 0.3 over their steps: a property of the model and the data, the same on every
# CPU; tests/unit/test_tolerances.py checks it).
GRAD_SCALE = 0.5


FP64_UNIT_ROUNDOFF = 2.0**-53


def short_sum_relative(num_terms: int, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """Two sums of the same ``num_terms`` float32 (or ``unit_roundoff``) terms in two orders
    differ by at most this times the sum of the terms' magnitudes: each is within
    gamma_{k-1} = (k-1)u / (1-(k-1)u) of it of the exact sum (Higham's deterministic
    bound), so 2 * gamma_{k-1}. (Measured: 0.48 of it, NO_SHARD's accumulation over 2 steps
    and 2 ranks, tests/dist/test_grad_buffer_reuse.py; a doubled gradient: 2.8e6 of it.)"""
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    ku = (num_terms - 1) * unit_roundoff
    return 2.0 * ku / (1.0 - ku)


def float64_formula_rtol(num_ops: int) -> float:
    """Two evaluations of one formula in Python floats (float64), each at most ``num_ops``
    operations that are correctly rounded (+ - * /) or within an ulp (libm's log, cos: 2u)
    and none cancelling, are each within num_ops * 2u of the exact value to first order,
    so apart by 4 * num_ops * u relative, u = 2**-53, whichever machine's libm."""
    return 4.0 * num_ops * FP64_UNIT_ROUNDOFF


def reordered_relative(sum_terms: int, chain_depth: int) -> float:
    """Two orders of one float32 value ``chain_depth`` sums deep, each of at most
    ``sum_terms`` terms, differ by this much relative to its terms' scale."""
    return 2.0 * math.sqrt(chain_depth * sum_terms) * FP32_UNIT_ROUNDOFF


# 2 * sqrt(80 * 64) * 2**-24 = 8.5e-6: two orders of one chained float32 value, relative.
REORDERED_RELATIVE = reordered_relative(SUM_TERMS, CHAIN_DEPTH)

# bfloat16 keeps 8 significant bits, float16 11: one rounding is within 2**-8 (2**-11) of
# the value.
BF16_UNIT_ROUNDOFF = 2.0**-8
FP16_UNIT_ROUNDOFF = 2.0**-11


def low_precision_relative(roundings: int, unit_roundoff: float = BF16_UNIT_ROUNDOFF) -> float:
    """Two runs of one value computed in bf16 (or fp16, ``unit_roundoff``), ``roundings``
    low-precision op outputs deep (forward and backward, the parameters' cast included),
    differ by this much relative to its terms' scale when their inputs or sums differ in
    order or by earlier roundings.

    CPU kernels for bf16 and fp16 (ATen's opmath, oneDNN) accumulate in fp32 and round each
    output once; the fp32 sum's own error, K * 2**-24 of its terms for K terms, stays under
    that one rounding for K < 2**13. So each op adds one low-precision rounding of the
    scale of its terms, whatever order it summed in, and the chain's roundings add up as
    the module docstring's do (one term each): 2 * sqrt(roundings) * unit_roundoff. Values
    must stay in range: fp16 steps that overflow are skipped by both runs' scalers."""
    return 2.0 * math.sqrt(roundings) * unit_roundoff


# AdamW for runs compared with a reordered reference. eps = 1e-3 caps the amplification at
# lr/eps = 10, and the updates stay Adam's where gradients are above 1e-3 (most elements
# of these models; each parameter tensor still moves by 3e-3 to 5e-2 in 3-5 steps, 7 to
# 100 times the bound below).
ADAMW_EPS = 1e-3
REORDER_SAFE_ADAMW = {"lr": 0.01, "eps": ADAMW_EPS}
ADAMW_LIPSCHITZ = 3.3  # sum over s of |d u_t / d g_s| in units of lr/eps, t <= 5
ADAMW_MAX_STEPS = 5  # the steps ADAMW_LIPSCHITZ holds for
# The steps over which a parameter difference's feedback into later gradients stays second
# order for SGD at the tests' learning rates (tests/unit/test_tolerances.py checks it).
SGD_MAX_STEPS = 5

# Losses and gradient norms are forward values: one chained value, relative.
REORDERED_VALUE_TOL = {"rtol": REORDERED_RELATIVE, "atol": 0.0}
# Gradients (no optimizer step between): one chained value on the scale of the gradients'
# terms, absolute (4.3e-6).
REORDERED_GRAD_TOL = {"rtol": 0.0, "atol": REORDERED_RELATIVE * GRAD_SCALE}


def reordered_param_atol(
    num_steps: int,
    lr: float = 0.01,
    eps: float = ADAMW_EPS,
    relative: float = REORDERED_RELATIVE,
    grad_scale: float = GRAD_SCALE,
) -> float:
    """Bound on how far one parameter element of two AdamW runs (``lr``, ``eps``) drifts
    apart in ``num_steps`` steps when their gradients differ by rounding only:
    ``num_steps * ADAMW_LIPSCHITZ * lr/eps * relative * grad_scale``."""
    if not 0 < num_steps <= ADAMW_MAX_STEPS:
        raise ValueError(f"num_steps must be in 1..{ADAMW_MAX_STEPS}, got {num_steps}")
    per_step = ADAMW_LIPSCHITZ * lr / eps * relative * grad_scale
    return num_steps * per_step


def reordered_sgd_param_atol(
    num_steps: int,
    lr: float,
    momentum: float,
    weight_decay: float = 0.0,
    relative: float = REORDERED_RELATIVE,
    grad_scale: float = GRAD_SCALE,
) -> float:
    """Bound on how far one parameter element of two SGD runs (``lr``, ``momentum``,
    coupled ``weight_decay``, dampening 0) drifts apart in ``num_steps`` steps when their
    gradients differ by rounding only (see the module docstring)."""
    if not 0 < num_steps <= SGD_MAX_STEPS:
        raise ValueError(f"num_steps must be in 1..{SGD_MAX_STEPS}, got {num_steps}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    weight = sum(sum(momentum**k for k in range(t)) for t in range(1, num_steps + 1))
    feedback = lr * weight_decay * weight
    if feedback >= 1.0:
        raise ValueError(f"lr * weight_decay * {weight:.2f} = {feedback:.2f}: no bound")
    return lr * weight * relative * grad_scale / (1.0 - feedback)


def reordered_loss_atol(
    loss: float, grad_l1: float, param_atol: float, relative: float = REORDERED_RELATIVE
) -> float:
    """Bound on how far two runs' ``loss`` values differ when their parameters are at most
    ``param_atol`` apart per element and ``grad_l1`` is the sum of the gradient's
    magnitudes: ``grad_l1 * param_atol`` to first order, plus the loss's own rounding."""
    return relative * abs(loss) + grad_l1 * param_atol


def reordered_loss_atols(
    losses: list[float],
    grad_l1s: list[float],
    largest_param: float,
    param_tol,
    relative: float = REORDERED_RELATIVE,
) -> list[float]:
    """Per step t (from 0) of a run compared with a reordered reference, the ``atol`` for
    its loss: :func:`reordered_loss_atol` of the reference's ``losses[t]`` and
    ``grad_l1s[t]`` (the sum of its gradient's magnitudes at that loss), the parameters
    apart by ``param_tol(t)`` (``assert_close`` keywords after t steps, as
    :func:`reordered_param_tol`; ``rtol`` taken of ``largest_param``) and not at all at
    t = 0. A loss compared with only its own rounding (``REORDERED_VALUE_TOL``) leaves
    out the drift of the steps before it."""
    atols = []
    for step, (loss, grad_l1) in enumerate(zip(losses, grad_l1s, strict=True)):
        drift = 0.0
        if step:
            tol = param_tol(step)
            drift = tol["atol"] + tol["rtol"] * largest_param
        atols.append(reordered_loss_atol(loss, grad_l1, drift, relative))
    return atols


def check_losses(got, want, atols: list[float], where: str = "") -> None:
    """Each step's loss of ``got`` within its ``atols`` entry of ``want``'s (floats or
    0-d tensors)."""
    assert len(got) == len(want) == len(atols), (where, len(got), len(want), len(atols))
    for step, (mine, theirs, atol) in enumerate(zip(got, want, atols, strict=True)):
        difference = abs(float(mine) - float(theirs))
        assert difference <= atol, f"{where} step {step}: {difference:.3g} > {atol:.3g}"


def reordered_norm_atol(
    norm_type: float,
    numel: int,
    norm: float,
    relative: float = REORDERED_RELATIVE,
    grad_scale: float = GRAD_SCALE,
) -> float:
    """Bound on how far two runs' ``norm_type``-norms of a gradient of ``numel`` elements
    (about ``norm``) differ when each element is off by rounding only.

    To first order the norm moves by sum_i w_i * d_i, w_i = (|g_i| / norm)**(p-1) sign g_i,
    the d_i independent and each within ``relative * grad_scale``: about |w|_2 times that,
    and |w|_2 <= 1 for p >= 2 and p = inf (sqrt(numel) for p = 1). The norm's own sum of
    ``numel`` terms adds 2 * sqrt(numel) * u of it (the module docstring's rounding)."""
    spread = math.sqrt(numel) if norm_type == 1 else 1.0
    if norm_type < 2 and norm_type != 1:
        raise ValueError(f"norm_type must be 1, >= 2 or inf, got {norm_type}")
    own = 0.0 if math.isinf(norm_type) else 2.0 * math.sqrt(numel) * FP32_UNIT_ROUNDOFF * norm
    return spread * relative * grad_scale + own


def clipped_grad_multiple(
    numel: int,
    max_norm: float,
    relative: float = REORDERED_RELATIVE,
    grad_scale: float = GRAD_SCALE,
) -> float:
    """The bound on a gradient of ``numel`` elements clipped by its 2-norm to ``max_norm``,
    in units of the unclipped one's (``relative * grad_scale``), for ``grad_scale`` of the
    param bounds above.

    Clipped, element i is g_i * c, c = max_norm / norm <= 1. Off by rounding d_i in g_i
    and D in the norm, it moves by c * d_i + |g_i| * c * D / norm <= d_i + D, as
    |g_i| <= norm for the 2-norm. D is :func:`reordered_norm_atol`, whose own-rounding part
    (proportional to the norm) c scales down to that at ``max_norm``. Hence
    1 + reordered_norm_atol(2, numel, max_norm) / (relative * grad_scale): about 2."""
    own = reordered_norm_atol(2.0, numel, max_norm, relative, grad_scale)
    return 1.0 + own / (relative * grad_scale)


def step_rounding_rtol(num_steps: int) -> float:
    """Each step rounds ``p - update`` to a float: two runs whose updates differ by any
    amount may land on neighbouring floats, one ulp (at most 2u of |p|) apart per step, on
    top of the updates' own difference (the ``atol`` bounds above)."""
    return num_steps * 2.0 * FP32_UNIT_ROUNDOFF


def reordered_param_tol(num_steps: int) -> dict[str, float]:
    """``assert_close`` keywords for parameters after ``num_steps`` steps of
    :data:`REORDER_SAFE_ADAMW` against a reordered reference (about 1.4e-4 per step)."""
    return {"rtol": step_rounding_rtol(num_steps), "atol": reordered_param_atol(num_steps)}


# [Note: forward bound]
# A forward pass through Linear layers and activations f with |f(z)| <= |z| and
# |f(z) - f(z')| <= |z - z'| (tanh, ReLU) on the same weights, with the matmuls blocked
# differently (MKL's kernels take another path for an operand at another alignment: a
# parameter viewed in a gathered flat buffer against one allocated on its own). Layer l
# computes W x + b in sums of K_l terms; each sum is within K_l*u*(|W||x| + |b|) of exact
# (the module docstring's rounding), and an error e in x reaches the output as at most
# |W_L|...|W_{l+1}| e. Let M be the magnitude network: the same layers with |W|, |b| and no
# activations, fed |x|. Then |W||x_l| + |b| <= M's layer-l output, |W_L|...|W_{l+1}| of it
# is at most M's output, and one run is within D*K*u*M(|x|) of exact for D layers of at
# most K terms; two orders, with independent roundings, :func:`reordered_relative` (K, D)
# of it. Hence :func:`reordered_forward_atol`.


def magnitude_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (``nn.Linear`` layers and the activations of [Note: forward
    bound], in containers that only chain their children: ``nn.Sequential``,
    tests.models.MLP) with every parameter replaced by its magnitude and every activation
    by the identity; fed ``|x|`` it bounds the terms of each output. A leaf module of
    another kind is refused."""
    magnitude = copy.deepcopy(model)
    for name, module in list(magnitude.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (nn.Tanh, nn.ReLU)):
                setattr(module, child_name, nn.Identity())
            elif not isinstance(child, (nn.Linear, nn.Sequential, nn.Identity)):
                if not list(child.children()):
                    raise TypeError(f"magnitude_model: no bound for {name}.{child_name}: {child}")
    with torch.no_grad():
        for param in magnitude.parameters():
            param.abs_()
    return magnitude


def reordered_forward_atol(model: nn.Module, x: torch.Tensor) -> float:
    """Bound on how far two runs of ``model``'s forward on ``x`` (Linear layers and tanh or
    ReLU; the same weights, matmuls blocked differently) differ per output element
    ([Note: forward bound]): ``reordered_relative(K, D) * max M(|x|)``, ``D`` the Linear
    layers, ``K`` the widest one's inputs plus its bias."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("reordered_forward_atol: model has no nn.Linear layer")
    terms = max(m.in_features + 1 for m in linears)
    with torch.no_grad():
        scale = float(magnitude_model(model)(x.abs()).abs().max())
    return reordered_relative(terms, len(linears)) * scale
