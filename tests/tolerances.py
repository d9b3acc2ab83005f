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
"""

from __future__ import annotations

import math

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
# 2 * sqrt(80 * 64) * 2**-24 = 8.5e-6: two orders of one chained float32 value, relative.
REORDERED_RELATIVE = 2.0 * math.sqrt(CHAIN_DEPTH * SUM_TERMS) * FP32_UNIT_ROUNDOFF

# AdamW for runs compared with a reordered reference. eps = 1e-3 caps the amplification at
# lr/eps = 10, and the updates stay Adam's where gradients are above 1e-3 (most elements
# of these models; each parameter tensor still moves by 3e-3 to 5e-2 in 3-5 steps, 7 to
# 100 times the bound below).
ADAMW_EPS = 1e-3
REORDER_SAFE_ADAMW = {"lr": 0.01, "eps": ADAMW_EPS}
ADAMW_LIPSCHITZ = 3.3  # sum over s of |d u_t / d g_s| in units of lr/eps, t <= 5
ADAMW_MAX_STEPS = 5  # the steps ADAMW_LIPSCHITZ holds for

# Losses and gradient norms are forward values: one chained value, relative.
REORDERED_VALUE_TOL = {"rtol": REORDERED_RELATIVE, "atol": 0.0}
# Gradients (no optimizer step between): one chained value on the scale of the gradients'
# terms, absolute (4.3e-6).
REORDERED_GRAD_TOL = {"rtol": 0.0, "atol": REORDERED_RELATIVE * GRAD_SCALE}


def reordered_param_atol(num_steps: int, lr: float = 0.01, eps: float = ADAMW_EPS) -> float:
    """Bound on how far one parameter element of two AdamW runs (``lr``, ``eps``) drifts
    apart in ``num_steps`` steps when their gradients differ by rounding only:
    ``num_steps * ADAMW_LIPSCHITZ * lr/eps * REORDERED_RELATIVE * GRAD_SCALE``."""
    if not 0 < num_steps <= ADAMW_MAX_STEPS:
        raise ValueError(f"num_steps must be in 1..{ADAMW_MAX_STEPS}, got {num_steps}")
    per_step = ADAMW_LIPSCHITZ * lr / eps * REORDERED_RELATIVE * GRAD_SCALE
    return num_steps * per_step


def reordered_param_tol(num_steps: int) -> dict[str, float]:
    """``assert_close`` keywords for parameters after ``num_steps`` steps of
    :data:`REORDER_SAFE_ADAMW` against a reordered reference (about 1.4e-4 per step)."""
    return {"rtol": 0.0, "atol": reordered_param_atol(num_steps)}
