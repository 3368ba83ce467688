"""drop_nonfinite and mark_dropped against torch.isfinite: the whole batch dropped, or none of it."""

from __future__ import annotations

import pytest
import torch
from draftgraph.ops.nonfinite import DROPPED, NONFINITE, finite_rows
from v4_op_cases import run_op

BF16_MAX = torch.finfo(torch.bfloat16).max


def hiddens(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 4, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("b", [1, 5])
def test_one_nonfinite_value_drops_every_row(bad, b):
    positions = torch.arange(b, dtype=torch.int64) * 7 + 3
    for row, stream, col in ((0, 0, 0), (b - 1, 3, 63), (b // 2, 2, 17)):
        h = hiddens(b, seed=row + col)
        h[row, stream, col] = bad
        assert not torch.isfinite(h).all()
        (out,) = run_op("drop_nonfinite", [positions, h], {})
        assert out.tolist() == [DROPPED] * b


@pytest.mark.parametrize("b", [1, 5])
def test_finite_hiddens_keep_their_positions_even_at_the_extremes(b):
    positions = torch.arange(b, dtype=torch.int64) * 7 + 3
    h = hiddens(b)
    h[0, 0, :4] = torch.tensor([BF16_MAX, -BF16_MAX, 1e-40, -0.0])  # the largest and a subnormal
    h[b - 1].fill_(BF16_MAX)  # a whole row at the largest finite value: no product or sum overflows
    assert torch.isfinite(h).all()
    (out,) = run_op("drop_nonfinite", [positions, h], {})
    assert torch.equal(out, positions)


def test_mark_dropped_marks_every_draft_of_a_dropped_row():
    drafts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    (out,) = run_op("mark_dropped", [drafts, torch.tensor([DROPPED, 4])], {})
    assert out.tolist() == [[NONFINITE] * 3, [8, 9, 10]]
    (out,) = run_op("mark_dropped", [drafts, torch.tensor([0, 4])], {})
    assert torch.equal(out, drafts)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_drop_nonfinite_on_cuda_and_captured():
    """cuBLAS's bf16 GEMV propagates a NaN or an infinity as the CPU's does, in a CUDA graph too."""
    from draftgraph.runtime.ir.op_registry import get_op

    op, b = get_op("drop_nonfinite"), 32
    positions = torch.arange(b, dtype=torch.int64, device="cuda")
    h = hiddens(b).to("cuda").contiguous()
    out = torch.full((b,), -7, dtype=torch.int64, device="cuda")
    op.impl([positions, h], [out], {}, None)  # eager first: the zeros constant is made outside the capture
    assert torch.equal(out, positions)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.impl([positions, h], [out], {}, None)
    for bad in (float("nan"), float("inf"), float("-inf")):
        h[b - 1, 3, 63] = bad
        graph.replay()
        assert out.tolist() == [DROPPED] * b, bad
    h[b - 1].fill_(BF16_MAX)
    graph.replay()
    assert torch.equal(out, positions)


def test_finite_rows_names_the_rows_holding_a_nan_or_an_infinity():
    rows = hiddens(6).reshape(6, -1)
    rows[1, 7], rows[3, 0], rows[4, -1] = float("nan"), float("inf"), float("-inf")
    rows[5].fill_(BF16_MAX)
    assert finite_rows(rows).tolist() == torch.isfinite(rows).all(1).tolist() == [True, False, True, False, False, True]
