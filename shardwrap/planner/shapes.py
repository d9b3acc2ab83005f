"""The unit size the planner assumes for a bare parameter count: one decoder layer.

[Note: the assumed model shape]
A parameter count says nothing about how the model is wrapped, yet ZeRO-3's peak is the
units it gathers. Counted as one unit, a 7e9 model would be gathered whole; wrapped as
usual (one unit per transformer layer) it gathers one layer and the prefetched next one.
So for a count the planner assumes a standard decoder: ``12 h^2`` parameters per layer
(attention ``4 h^2``, a ``4h`` MLP ``8 h^2``; biases and norms left out), ``h`` the hidden
size, each layer one unit, the rest of the count (embeddings, head) in the root unit.

``h`` comes from ``--hidden`` when given, else from ``--layers`` (``h = isqrt(P / (12 L))``),
else from this table of common shapes (GPT-3's, LLaMA's): the row with the largest layer
stack ``12 L h^2`` that is at most ``P``. Above the table (``P >= 12 x 96 x 12288^2``,
about 174e9) the rule that fits its large rows, ``L = h / 128``, gives ``P = 3 h^3 / 32``, so
``h = 128 * round(cbrt(32 P / 3) / 128)``. Below it (``P < 12 x 12 x 768^2``, about 85e6),
12 layers of ``h`` = the largest multiple of 64 that fits; a model too small for even that
is one unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# (hidden, layers): GPT-3 125M .. 2.7B and 175B, LLaMA 7B, 13B, 33B, 65B/70B
COMMON_SHAPES = (
    (768, 12),
    (1024, 24),
    (1536, 24),
    (2048, 24),
    (2560, 32),
    (4096, 32),
    (5120, 40),
    (6656, 60),
    (8192, 80),
    (12288, 96),
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The decoder a parameter count is assumed to be; ``hidden == 0``: one unit."""

    num_params: int
    hidden: int
    layer_params: int  # one unit: 12 * hidden**2 (the whole model when hidden == 0)
    num_layers: int
    source: str  # where hidden came from

    @property
    def root_params(self) -> int:
        """Parameters outside the layers (embeddings, head): the root unit."""
        return self.num_params - self.layer_params * self.num_layers

    def describe(self) -> str:
        if self.hidden == 0:
            return f"assumed: the whole model ({self.num_params:,} parameters) is one unit"
        return (
            f"assumed: {self.num_layers} decoder layers of 12 x hidden^2 = "
            f"{self.layer_params:,} parameters, hidden {self.hidden} ({self.source}), one unit "
            f"each;\n  {self.root_params:,} in the root unit (embeddings, head). ZeRO-3 gathers at "
            "most 2 layers (the one computing and the prefetched one);\n  change with --hidden, "
            "--layers or --largest-unit-params"
        )


def assumed_shape(num_params: int, layers: int | None = None, hidden: int | None = None):
    """The :class:`ModelShape` of ``num_params``; see [Note: the assumed model shape]."""
    for name, value in (("layers", layers), ("hidden", hidden)):
        if value is not None and (isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if hidden is not None:
        source = "given"
    elif layers is not None:
        hidden, source = math.isqrt(num_params // (12 * layers)), "from the layers given"
    else:
        hidden, source = _table_hidden(num_params)
    layer_params = 12 * hidden * hidden
    if layer_params == 0 or layer_params > num_params:
        if source == "given":
            raise ValueError(f"hidden: 12 x {hidden}^2 is more than the {num_params:,} parameters")
        return ModelShape(num_params, 0, num_params, 1, "too small for a layer")
    count = num_params // layer_params if layers is None else layers
    if count * layer_params > num_params:
        raise ValueError(
            f"layers, hidden: {count} x 12 x {hidden}^2 is more than {num_params:,} parameters"
        )
    return ModelShape(num_params, hidden, layer_params, count, source)


def _table_hidden(num_params: int) -> tuple[int, str]:
    last_hidden, last_layers = COMMON_SHAPES[-1]
    if num_params >= 12 * last_layers * last_hidden**2:
        hidden = 128 * round((32 * num_params / 3) ** (1 / 3) / 128)
        return hidden, "rule h = 128 * round(cbrt(32 P / 3) / 128)"
    fitting = [h for h, n in COMMON_SHAPES if 12 * n * h * h <= num_params]
    if fitting:
        return fitting[-1], "table of common shapes"
    return 64 * (math.isqrt(num_params // 144) // 64), "12 layers, a multiple of 64"
