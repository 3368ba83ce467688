"""FP8 e4m3 (128x128) and MXFP4 (1x32) block quantisation against independent oracles.

The oracles never call the code under test: the e4m3 grid comes from reinterpreting all 256
bytes as ``float8_e4m3fn``, the e2m1 grid is written out by hand, and the error bounds are
derived from the formats (see each test).
"""

from __future__ import annotations

import struct

import pytest
import torch
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.model.quant import (
    dequantize_fp8,
    dequantize_mxfp4,
    e2m1_codes,
    fp8_scale_shape,
    mxfp4_shapes,
    pack_e2m1,
    quantize_fp8,
    quantize_mxfp4,
    scale_to_float,
    unpack_e2m1,
)
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _wide_range(shape, seed):
    """Gaussian values spread over ~8 binades, so blocks mix large and subnormal-range codes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randn(shape, generator=g) * 2)


def _block_scales(scale, rows, cols, br, bc):
    """The factor of every element, by indexing (not by repeat_interleave, which the code uses)."""
    factors = torch.tensor([2.0 ** (b - 127) for b in scale.view(torch.uint8).flatten().tolist()])
    factors = factors.view(scale.shape)
    r = torch.arange(rows)[:, None] // br
    c = torch.arange(cols)[None, :] // bc
    return factors[r, c]


def _e4m3_grid():
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)].unique()


# ---- FP8 ---------------------------------------------------------------------------------------


def test_fp8_scale_layout():
    q, scale = quantize_fp8(torch.randn(300, 200))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 2)
    assert fp8_scale_shape((4096, 4096)) == (32, 32)
    assert fp8_scale_shape((8192, 4096)) == (64, 32)  # V4-Flash wo_a
    assert fp8_scale_shape((64, 256)) == (1, 2)  # a partial block is still one scale


def test_fp8_round_trip_within_e4m3_error():
    w = _wide_range((300, 260), seed=1)  # ragged edge blocks on both axes
    q, scale = quantize_fp8(w)
    back = dequantize_fp8(q, scale, torch.float32)
    s = _block_scales(scale, 300, 260, 128, 128)
    # e4m3 has 3 mantissa bits: a normal code is within 2^-4 relative; below 2^-6 (subnormals,
    # step 2^-9) the error is at most half a step, 2^-10, in units of the block scale.
    bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)
    err = (back - w).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max()}"
    assert err.max() > 0  # the data really is being quantised


def test_fp8_is_nearest_grid_point():
    w = _wide_range((256, 256), seed=2)
    q, scale = quantize_fp8(w)
    s = _block_scales(scale, 256, 256, 128, 128)
    scaled = (w / s).flatten()
    grid = _e4m3_grid()
    nearest = (scaled[:, None] - grid[None, :]).abs().min(dim=1).values
    got = (q.float().flatten() - scaled).abs()
    torch.testing.assert_close(got, nearest, rtol=0, atol=0)


def test_fp8_scale_is_the_smallest_power_of_two_that_fits():
    w = _wide_range((256, 384), seed=3)
    _, scale = quantize_fp8(w)
    s = _block_scales(scale, 256, 384, 128, 128)[::128, ::128]
    amax = w.abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    ratio = amax / s
    assert ((ratio > 224) & (ratio <= 448)).all(), ratio


def test_fp8_blocks_are_independent():
    w = _wide_range((256, 256), seed=4)
    w2 = w.clone()
    w2[128:, :128] *= 8.0  # one block, scaled by 2^3
    q1, s1 = quantize_fp8(w)
    q2, s2 = quantize_fp8(w2)
    e1, e2 = s1.view(torch.uint8).int(), s2.view(torch.uint8).int()
    assert (e2 - e1).tolist() == [[0, 0], [3, 0]]
    assert torch.equal(q1.float(), q2.float())


def test_fp8_zero_block_and_fp32_factor_scales():
    w = torch.zeros(128, 256)
    w[:, 128:] = torch.randn(128, 128)
    q, scale = quantize_fp8(w)
    back = dequantize_fp8(q, scale, torch.float32)
    assert (back[:, :128] == 0).all()
    # DeepSeek-V3 style fp32 factors and raw exponent bytes mean the same thing.
    as_f32 = scale_to_float(scale)
    assert torch.equal(dequantize_fp8(q, as_f32, torch.float32), back)
    assert torch.equal(dequantize_fp8(q, scale.view(torch.uint8), torch.float32), back)


def test_fp8_rejects_wrong_scale_shape():
    q, scale = quantize_fp8(torch.randn(256, 256))
    with pytest.raises(InputError, match=r"expected \[2, 2\], got \[1, 2\]"):
        dequantize_fp8(q, scale[:1], torch.float32)


# ---- MXFP4 -------------------------------------------------------------------------------------


def test_e2m1_hand_picked_codes_and_bytes():
    # Row of 32: every magnitude, then every negative one, then zeros; amax 6 -> scale 2^0.
    values = E2M1 + [-v for v in E2M1] + [0.0] * 16
    w = torch.tensor([values, [v * 8 for v in values]])  # second row: the same at scale 2^3
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 16)
    assert scale.view(torch.uint8).tolist() == [[127], [130]]
    # Even element in the low nibble: (0, 0.5) -> 0x10, (1, 1.5) -> 0x32, (2, 3) -> 0x54,
    # (4, 6) -> 0x76; negatives set bit 3: (-0 -> code 0, -0.5 -> 9) -> 0x90, (-1, -1.5) -> 0xBA ...
    expected = [0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE] + [0] * 8
    assert packed.view(torch.uint8)[0].tolist() == expected
    assert packed.view(torch.uint8)[1].tolist() == expected
    back = dequantize_mxfp4(packed, scale, torch.float32)
    assert back.tolist() == w.tolist()


def test_e2m1_ties_go_to_even_codes():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # Between codes (0,1) (1,2) (2,3) (3,4) (4,5) (5,6) (6,7) the even one wins.
    assert e2m1_codes(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_codes(-mids).tolist() == [0, 10, 10, 12, 12, 14, 14]
    assert e2m1_codes(torch.tensor([7.0, 100.0])).tolist() == [7, 7]  # saturates at 6


def test_pack_unpack_every_byte():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = unpack_e2m1(every)
    assert codes[0::2].tolist() == [b & 0xF for b in range(256)]
    assert codes[1::2].tolist() == [b >> 4 for b in range(256)]
    assert torch.equal(pack_e2m1(codes).view(torch.uint8), every)


def test_mxfp4_layout_shapes():
    assert mxfp4_shapes((2048, 4096)) == ((2048, 2048), (2048, 128))  # V4-Flash w1 / w3
    assert mxfp4_shapes((4096, 2048)) == ((4096, 1024), (4096, 64))  # w2
    with pytest.raises(InputError, match="multiple of 32"):
        mxfp4_shapes((4, 48))


def test_mxfp4_round_trip_within_e2m1_error():
    w = _wide_range((64, 512), seed=5)
    packed, scale = quantize_mxfp4(w)
    back = dequantize_mxfp4(packed, scale, torch.float32)
    s = _block_scales(scale, 64, 512, 1, 32)
    # e2m1 has 1 mantissa bit: from 1 up the grid steps are 0.5, 1, 2 at binade starts 1, 2, 4,
    # so a scaled value >= 1 is within 1/4 relative; below 1 the step is 0.5, so within 0.25.
    bound = torch.maximum(w.abs() * 0.25, s * 0.25)
    err = (back - w).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max()}"


def test_mxfp4_is_nearest_grid_point_with_minimal_scale():
    w = _wide_range((32, 256), seed=6)
    packed, scale = quantize_mxfp4(w)
    s = _block_scales(scale, 32, 256, 1, 32)
    grid = torch.tensor(E2M1 + [-v for v in E2M1[1:]])
    scaled = (w / s).flatten()
    nearest = (scaled[:, None] - grid[None, :]).abs().min(dim=1).values
    got = (dequantize_mxfp4(packed, scale, torch.float32) / s).flatten()
    torch.testing.assert_close((got - scaled).abs(), nearest, rtol=0, atol=0)
    ratio = w.abs().view(32, 8, 32).amax(-1) / s[:, ::32]
    assert ((ratio > 3) & (ratio <= 6)).all(), ratio


def test_mxfp4_rejects_wrong_scale_shape():
    packed, scale = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(InputError, match="MXFP4 scale shape"):
        dequantize_mxfp4(packed, scale[:, :1])


def test_ue8m0_scales_round_trip_through_safetensors(tmp_path):
    _, scale = quantize_fp8(_wide_range((256, 256), seed=7))
    path = tmp_path / "s.safetensors"
    save_file({"w.scale": scale}, str(path))
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert b'"dtype":"F8_E8M0"' in raw[8 : 8 + length]  # the real checkpoint's dtype spelling
    back = load_file(str(path))["w.scale"]
    assert back.dtype == torch.float8_e8m0fnu
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))
