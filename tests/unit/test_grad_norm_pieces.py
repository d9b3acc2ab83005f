"""The gradient norm is taken over pieces of each gradient; the result does not depend on that."""

from __future__ import annotations

import math

import pytest
import torch

from shardwrap.features import grad_clip
from tests import tolerances


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norm_over_pieces_matches_the_whole(monkeypatch, norm_type):
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    grads.append(torch.empty(0))
    whole = torch.linalg.vector_norm(torch.cat(grads).double(), ord=norm_type)
    monkeypatch.setattr(grad_clip, "NORM_PIECE", 97)  # odd: pieces of unequal length
    partial = grad_clip._partial(grads, norm_type)
    total = partial if norm_type == math.inf else partial.pow(1.0 / norm_type)
    if norm_type == math.inf:  # a max is exact whatever the pieces
        assert total.item() == whole.item()
    else:
        # float64 sums of the same positive terms |g|^p in other orders (2 gamma_{k-1} of
        # the sum), each term's power and the root within an ulp in each (6u more; the
        # root divides the rest by p >= 1)
        terms = sum(g.numel() for g in grads)
        u = tolerances.FP64_UNIT_ROUNDOFF
        rtol = tolerances.short_sum_relative(terms, u) + 6.0 * u
        torch.testing.assert_close(total, whole, rtol=rtol, atol=0.0)
