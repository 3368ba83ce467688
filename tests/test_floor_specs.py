"""The floor's bytes come from the weights' specs (issue 28.1): at V4-Flash shapes, in the
checkpoint's formats, against oracles that never build a graph: the stored checkpoint layout
(weight_names.checkpoint_layout) and the byte counts written out by hand from the formats."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.weight_names import MTP_TENSOR_NAMES, checkpoint_layout

ROOT = Path(__file__).resolve().parents[1]
FLASH = V4Config.flash()
STORED_BYTES = {"BF16": 2, "F32": 4, "I32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


@pytest.fixture(scope="module")
def bench_floor():
    spec = importlib.util.spec_from_file_location("bench_floor", ROOT / "benchmarks" / "bench_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fp8_bytes(rows: int, cols: int) -> int:
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)


def mxfp4_bytes(rows: int, cols: int) -> int:
    return rows * cols // 2 + rows * cols // 32


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "bf16"])
def test_weight_bytes_from_specs_equal_the_stored_checkpoint(bench_floor, fmt):
    stored = sum(math.prod(e.shape) * STORED_BYTES[e.dtype] for e in checkpoint_layout(MTP_TENSOR_NAMES(FLASH), fmt))
    assert bench_floor.weight_bytes(bench_floor.floor_graph(FLASH, fmt)) == stored


def test_flash_weights_native_against_bf16(bench_floor):
    native = bench_floor.weight_bytes(bench_floor.floor_graph(FLASH, "mxfp4"))
    bf16 = bench_floor.weight_bytes(bench_floor.floor_graph(FLASH, "bf16"))
    assert 5.6e9 < native < 5.8e9 and 15.2e9 < bf16 < 15.4e9, (native, bf16)


def test_real_format_floor_at_batch_1(bench_floor):
    c = FLASH
    d, h, hd, ql = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
    g, ol, inter, k = c.o_groups, c.o_lora_rank, c.moe_intermediate_size, c.num_experts_per_tok
    groups = bench_floor.step_weight_bytes(c)
    assert groups["lm head"] == c.vocab_size * d * 2
    assert groups["attention"] == (fp8_bytes(ql, d) + fp8_bytes(h * hd, ql) + fp8_bytes(hd, d)
                                   + fp8_bytes(g * ol, h * hd // g) + fp8_bytes(d, g * ol) + h * 4)  # + the fp32 sink
    assert groups["e_proj+h_proj"] == 2 * fp8_bytes(d, d)
    routed = k * (2 * mxfp4_bytes(inter, d) + mxfp4_bytes(d, inter))
    shared = 2 * fp8_bytes(inter, d) + fp8_bytes(d, inter)
    assert groups["experts"] == routed + shared
    assert groups["gate"] == c.n_routed_experts * (d * 2 + 4)
    assert groups["kv window"] == c.sliding_window * c.cache_head_dim * 2
    total = sum(groups.values())
    print(f"floor bytes B=1: {total / 1e9:.3f} GB " + ", ".join(f"{n} {v / 1e6:.1f} MB" for n, v in groups.items()))
    assert 1.30e9 < total < 1.32e9
    # The head 1.06 GB, attention 107 MB, e_proj + h_proj 34 MB, six MXFP4 experts 80 MB, the FP8 shared 25 MB.
    assert round(groups["lm head"] / 1e7) == 106 and round(groups["attention"] / 1e6) == 107
    assert round(routed / 1e6) == 80 and round(shared / 1e6) == 25
    bf16 = sum(bench_floor.step_weight_bytes(c, fmt="bf16").values())
    assert bf16 > total + 3.5e8  # the bf16 floor reads 2x the FP8 and ~3.6x the MXFP4 bytes
