"""Weights kept in the checkpoint's formats (issue 28.1): QuantWeight, its spec, the loader's
``weights="native"``, and FP8 rounding of activations and KV rows against float64 models.

The float64 models never call the code under test: e4m3 rounding is a search of the e4m3
grid (all 256 bytes decoded) for the nearest value, ties to the even code; the scale is the
reference's 2^ceil(log2(max(amax, 1e-4) / 448)) with the division in fp32, as the
reference's kernel does it.
"""

from __future__ import annotations

import math

import pytest
import torch
from draftgraph.ops.attention import fp8_round_blocks_
from draftgraph.runtime.errors import InputError, WeightError
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.ir.serialize import dumps, from_json
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.checkpoint_writer import write_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import (
    QuantWeight,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_rows,
    fp8_round_activations,
    quantize_fp8,
    quantize_weight,
)
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weights import load_checkpoint

CFG = V4Config.small()
F64 = torch.float64

# ---- the float64 models -------------------------------------------------------------------

_CODES = torch.arange(256, dtype=torch.uint8)
_GRID = _CODES.view(torch.float8_e4m3fn).to(F64)
_FINITE = torch.isfinite(_GRID)
GRID, GRID_CODES = _GRID[_FINITE], _CODES[_FINITE]


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value of each float64 element (|v| <= 448), ties to the even code."""
    dist = (v.reshape(-1, 1) - GRID.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    even = tied & (GRID_CODES.reshape(1, -1) % 2 == 0)
    pick = torch.where(even.any(dim=1, keepdim=True), even, tied).float().argmax(dim=1)
    return GRID[pick].reshape(v.shape)


def ref_scale(amax: float) -> float:
    """2^ceil(log2(max(amax, 1e-4) / 448)), the division in fp32 as the reference's kernel does it."""
    y = float(torch.tensor(max(amax, 1e-4), dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32))
    mantissa, exponent = math.frexp(y)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def fp8_round_model(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each 1 x ``block`` run of the last dim rounded through e4m3 with its power-of-two scale, float64."""
    v = x.to(F64)
    out = torch.empty_like(v)
    flat, res = v.reshape(-1, v.shape[-1]), out.reshape(-1, v.shape[-1])
    for r in range(flat.shape[0]):
        for start in range(0, flat.shape[1], block):
            run = flat[r, start : start + block]
            s = ref_scale(float(run.abs().max()))
            res[r, start : start + block] = round_e4m3((run / s).clamp(-448, 448)) * s
    return out


# ---- QuantWeight ------------------------------------------------------------------------------


def test_quant_weight_rows_are_the_whole_dequantisation_cut():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    q = quantize_weight(w, "fp8")
    whole = dequantize_fp8(q.data, q.scale)
    assert torch.equal(q.dequantize(), whole)
    for start, stop in ((0, 128), (130, 200), (255, 300), (5, 6)):
        assert torch.equal(dequantize_rows(q, start, stop), whole[start:stop])
    m = quantize_weight(torch.randn(3, 64, 96, generator=gen), "mxfp4")
    assert m.logical_shape == (3, 64, 96) and m.shape == (3, 64, 48) and m.scale.shape == (3, 64, 3)
    for e in range(3):
        packed = m.data[e].view(torch.int8)
        assert torch.equal(m[e].dequantize(), dequantize_mxfp4(packed, m.scale[e]))
        assert torch.equal(dequantize_rows(m, 10, 20)[e], dequantize_mxfp4(packed, m.scale[e])[10:20])


def test_quant_weight_refuses_mismatched_parts():
    q, s = quantize_fp8(torch.randn(256, 128))
    with pytest.raises(InputError, match="scale shape"):
        QuantWeight(q, s[:1], "fp8")
    with pytest.raises(InputError, match="dtypes"):
        QuantWeight(q.float(), s, "fp8")
    with pytest.raises(InputError, match="format"):
        QuantWeight(q, s, "int4")


def test_spec_prints_and_counts_the_format():
    q = quantize_weight(torch.randn(384, 256), "fp8")
    spec = TensorSpec.of(q)
    assert spec.short() == "f8e4m3[384,256] scale ue8m0[3,2]"
    assert spec.nbytes(1) == 384 * 256 + 6 == q.nbytes
    m = TensorSpec.of(quantize_weight(torch.randn(2, 8, 64), "mxfp4"))
    assert m.short() == "f4e2m1x2[2,8,32] scale ue8m0[2,8,2]" and m.logical_shape == (2, 8, 64)
    assert m.nbytes(1) == 2 * 8 * 32 + 2 * 8 * 2
    assert TensorSpec.from_json(spec.to_json()) == spec and TensorSpec.from_json(m.to_json()) == m
    assert TensorSpec.of(torch.zeros(3, dtype=torch.bfloat16)).to_json() == {"shape": [3], "dtype": "bf16"}


def test_spec_refuses_an_inconsistent_format():
    from draftgraph.runtime.errors import GraphError

    scale = TensorSpec((1, 1), torch.float8_e8m0fnu)
    with pytest.raises(GraphError, match="quant"):
        TensorSpec((128, 128), torch.bfloat16, "fp8", scale)
    with pytest.raises(GraphError, match="quant"):
        TensorSpec((128, 128), torch.float8_e4m3fn, "fp8", None)
    with pytest.raises(GraphError, match="scale"):
        TensorSpec((128, 128), torch.float8_e4m3fn, "fp8", TensorSpec((1, 1), torch.float32))


def test_native_chain_prints_and_round_trips_the_formats():
    from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
    from draftgraph.graphs.v4_block import CacheGeometry, Numerics, checkpoint_formats
    from golden_files import check_golden

    numerics = Numerics(checkpoint_formats(CFG, "mxfp4"), kv_fp8_round=True)
    graph = build_draft_chain(CFG, CacheGeometry(64, 4), ChainSpec(numerics=numerics))
    text = format_graph(graph)
    assert "@mtp.0.attn.wq_b.weight: f8e4m3[512,64] scale ue8m0[4,1]" in text
    assert "@mtp.0.ffn.experts.stacked.w1: f4e2m1x2[16,128,128] scale ue8m0[16,128,8]" in text
    assert "@head.weight: bf16[1000,256]" in text and "kv_fp8_round=true" in text
    assert format_graph(from_json(dumps(graph))) == text
    check_golden("dump_k1_streams_native_declared.txt", text + "\n")


# ---- loading ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    weights = random_mtp_weights(CFG, seed=3)
    for fmt in ("bf16", "fp8", "mxfp4"):
        write_checkpoint(root / fmt, CFG, weights, fmt=fmt)
    return root


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_native_load_keeps_the_stored_format_and_dequantises_to_the_bf16_load(checkpoints, fmt):
    native = load_checkpoint(checkpoints / fmt, weights="native")
    bf16 = load_checkpoint(checkpoints / fmt)
    kinds = {}
    for name, t in native.tensors.items():
        if isinstance(t, QuantWeight):
            kinds[t.fmt] = kinds.get(t.fmt, 0) + 1
            assert native.source[name] == t.fmt
            assert torch.equal(t.dequantize(), bf16.tensors[name]), name  # the same values, bit for bit
        else:
            assert torch.equal(t, bf16.tensors[name]), name
    e = CFG.n_routed_experts
    want = {"fp8": 2 + 5 + 3 + (3 * e if fmt == "fp8" else 0)} | ({"mxfp4": 3 * e} if fmt == "mxfp4" else {})
    assert kinds == want
    assert native.nbytes < bf16.nbytes


def test_a_bf16_checkpoint_stays_bf16_native(checkpoints):
    native = load_checkpoint(checkpoints / "bf16", weights="native")
    assert not any(isinstance(t, QuantWeight) for t in native.tensors.values())


def test_weights_option_is_checked_before_any_read(tmp_path):
    with pytest.raises(InputError, match="weights"):
        load_checkpoint(tmp_path / "nothing-here", weights="fp16")  # no WeightError about the path: checked first


def test_native_load_refuses_fp32_scales_that_are_not_powers_of_two(tmp_path):
    from safetensors.torch import load_file, save_file

    weights = random_mtp_weights(CFG, seed=4)
    write_checkpoint(tmp_path / "ck", CFG, weights, fmt="fp8")
    file = next((tmp_path / "ck").glob("*.safetensors"))
    tensors = load_file(str(file))
    name = "mtp.0.e_proj.scale"
    tensors[name] = torch.full(tensors[name].shape, 0.3)  # V3-style factors, not powers of two
    save_file(tensors, str(file))
    assert load_checkpoint(tmp_path / "ck").tensors["mtp.0.e_proj.weight"].dtype == torch.bfloat16  # bf16: fine
    with pytest.raises(WeightError, match="powers of two"):
        load_checkpoint(tmp_path / "ck", weights="native")


# ---- FP8 rounding of activations and KV rows against the float64 models --------------------


@pytest.mark.parametrize("width", [128, 256, 200, 64])
def test_activation_rounding_matches_the_float64_model(width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(3, width, generator=gen) * torch.logspace(-3, 2, width)).bfloat16()
    x[1, :40] = 0.0  # a run that is partly (or wholly) zero
    got = fp8_round_activations(x)
    assert got.dtype == torch.bfloat16
    want = fp8_round_model(x, 128)
    assert torch.equal(got.to(F64), want)  # exact: e4m3 times a power of two fits bf16
    assert not torch.equal(got, x)


def test_kv_rounding_matches_the_float64_model():
    gen = torch.Generator().manual_seed(1)
    for n in (448, 96):  # V4-Flash's non-rotary width (seven whole blocks), and a partial last block
        v = torch.randn(4, n, generator=gen) * torch.logspace(-4, 1, n)
        want = fp8_round_model(v, 64)
        fp8_round_blocks_(v)
        assert torch.equal(v.to(F64), want)
