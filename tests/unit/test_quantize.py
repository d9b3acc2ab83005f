"""Block quantization (base/quantize.py): the error bound, the wire rows, the codec's checks."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import shardwrap.base.quantize as quantize_module
from shardwrap.base.quantize import (
    BlockCodec,
    dequantize,
    dequantize_blocks,
    quantize,
    quantize_blocks,
)

# Beyond the s/2 of rounding to the nearest integer, fp32 rounds x / s and q * s: each
# within an ulp of a value at most qmax * s, so a few ulps of qmax * s on top.
FP32_SLACK_ULPS = 4 * 2.0**-23

CODECS = [BlockCodec(8, 2), BlockCodec(8, 16), BlockCodec(4, 4), BlockCodec(4, 256)]
# Normal fp32 magnitudes: a block's scale (max / qmax) then stays a normal number.
values = st.one_of(
    st.just(0.0),
    st.floats(2.0**-100, 2.0**100, width=32),
    st.floats(-(2.0**100), -(2.0**-100), width=32),
)


def _bound(x: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    """Per element: half its block's scale, plus fp32 slack."""
    _, scales = quantize_blocks(x, codec)
    per_block = scales * (0.5 + codec.qmax * FP32_SLACK_ULPS)
    return per_block.repeat_interleave(codec.block_size, dim=-1)[..., : x.shape[-1]]


@settings(max_examples=150, deadline=None)
@given(st.lists(values, min_size=1, max_size=70), st.sampled_from(CODECS))
def test_round_trip_within_half_a_scale(xs: list[float], codec: BlockCodec) -> None:
    x = torch.tensor(xs, dtype=torch.float32)
    back = dequantize(quantize(x, codec), x.numel(), codec)
    assert back.shape == x.shape
    assert torch.all((back.double() - x.double()).abs() <= _bound(x, codec).double())


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 40),
    st.sampled_from(CODECS),
    st.integers(0, 2**31 - 1),
)
def test_rows_quantize_independently(rows: int, numel: int, codec: BlockCodec, seed: int) -> None:
    """A matrix's rows are each quantized as if alone (what the collectives rely on)."""
    x = torch.randn(rows, numel, generator=torch.Generator().manual_seed(seed))
    wire = quantize(x, codec)
    assert wire.shape == (rows, codec.row_bytes(numel)) and wire.dtype == torch.uint8
    for r in range(rows):
        assert torch.equal(wire[r], quantize(x[r], codec))
    assert torch.equal(dequantize(wire, numel, codec)[1:], dequantize(wire[1:], numel, codec))


@settings(max_examples=60, deadline=None)
@given(st.lists(values, min_size=1, max_size=40), st.sampled_from(CODECS))
def test_integers_in_range_and_extremes_exact(xs: list[float], codec: BlockCodec) -> None:
    x = torch.tensor(xs, dtype=torch.float32)
    q, scales = quantize_blocks(x, codec)
    assert int(q.abs().max()) <= codec.qmax
    # the largest magnitude of each block maps to +-qmax (unless the block is all zeros)
    nonzero = scales > 0
    assert torch.all(q.abs().amax(-1)[nonzero] == codec.qmax)
    assert torch.all(dequantize_blocks(q, scales, x.numel())[x == 0] == 0)
    # the wire rows carry exactly these integers and scales
    for c in (codec, BlockCodec(8, codec.block_size)):
        q, scales = quantize_blocks(x, c)
        reference = dequantize_blocks(q, scales, x.numel())
        assert torch.equal(dequantize(quantize(x, c), x.numel(), c), reference)


def test_wire_bytes_per_value() -> None:
    """int8: 1 byte + 4/256 per value; int4: half a byte + 4/256 (block 256)."""
    n = 256 * 10
    assert BlockCodec(8, 256).row_bytes(n) == n + 40
    assert BlockCodec(4, 256).row_bytes(n) == n // 2 + 40
    assert BlockCodec(8, 256).row_bytes(n + 1) == n + 1 + 44  # a partial last block
    assert BlockCodec(4, 256).row_bytes(n + 1) == n // 2 + 1 + 44
    assert BlockCodec(8, 256).row_bytes(n) / (4 * n) <= 0.27
    assert BlockCodec(4, 256).row_bytes(n) / (4 * n) <= 0.15


def test_low_precision_inputs_and_outputs() -> None:
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    codec = BlockCodec(8, 32)
    back = dequantize(quantize(x, codec), 100, codec, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    reference = dequantize(quantize(x.float(), codec), 100, codec)
    torch.testing.assert_close(back, reference.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 2}, "bits"),
        ({"bits": True}, "bits"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 7}, "block_size"),
        ({"block_size": 8.0}, "block_size"),
    ],
)
def test_codec_checks_its_fields(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        BlockCodec(**kwargs)


def test_dequantize_refuses_rows_of_another_length() -> None:
    codec = BlockCodec(8, 16)
    with pytest.raises(ValueError, match="rows"):
        dequantize(quantize(torch.randn(20), codec), 40, codec)


@pytest.mark.parametrize("codec", CODECS)
def test_dequantize_into_a_strided_output(codec: BlockCodec) -> None:
    x = torch.randn(3, 45, generator=torch.Generator().manual_seed(0))
    wire = quantize(x, codec)
    target = torch.zeros(3, 50, dtype=torch.bfloat16)
    out = dequantize(wire, 45, codec, out=target[:, 5:])
    assert out.data_ptr() == target[:, 5:].data_ptr()
    assert torch.equal(target[:, 5:], dequantize(wire, 45, codec).to(torch.bfloat16))
    assert torch.all(target[:, :5] == 0)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("chunk_values", [16, 100, 1 << 18])
def test_chunked_work_matches_the_whole_row_reference(
    codec: BlockCodec, chunk_values: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows quantized and dequantized a chunk of blocks at a time (many chunks, a partial
    last one, a partial last block) carry the integers and scales of the unchunked
    reference, and come back as its values, bit for bit."""
    monkeypatch.setattr(quantize_module, "_CHUNK_VALUES", chunk_values)
    x = torch.randn(2, 1001, generator=torch.Generator().manual_seed(3)) * 5
    q, scales = quantize_blocks(x, codec)
    reference = dequantize_blocks(q, scales, x.numel() // 2)
    wire = torch.full((2, codec.row_bytes(1001)), 255, dtype=torch.uint8)
    assert quantize(x, codec, out=wire) is wire
    assert torch.equal(dequantize(wire, 1001, codec), reference)
    as_bf16 = dequantize(wire, 1001, codec, torch.bfloat16)
    assert torch.equal(as_bf16, dequantize_blocks(q, scales, 1001, torch.bfloat16))
