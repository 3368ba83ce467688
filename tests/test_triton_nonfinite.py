"""The one-kernel drop_nonfinite and mark_dropped against their torch ops (ops/nonfinite.py).

Without CUDA the kernels run under Triton's CPU interpreter; on a GPU also captured in a CUDA
graph, replayed with new hiddens (the verdict is read on the device every replay).
"""

from __future__ import annotations

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import HAS_CUDA, INTERPRET, load_kernel_modules

K = load_kernel_modules(["_common", "nonfinite"])
NF = K["nonfinite"]

from draftgraph.ops.nonfinite import DROPPED, NONFINITE  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRET, reason="the interpreter tests run where there is no CUDA")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEVICES = [pytest.param("cpu", marks=cpu_only), pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
BF16_MAX = torch.finfo(torch.bfloat16).max


def hiddens(b: int, d: int, device: str, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 4, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(device)


def drop(positions, h):
    out = torch.full_like(positions, -7)
    NF.drop_nonfinite_impl([positions, h], [out], {}, None)
    return out


@pytest.mark.parametrize("device", DEVICES)
# 33 x 4 x 160 = 21120 values: two tiles, the second partial; 33 x 4 x 320 = 42240: three tiles
# (the bad values in the first, second and last); from DROP_GRID_MIN_ROWS (4) rows a program a
# tile and a merge, below it one program looping over the tiles (3 x 4 x 2048: two of them)
@pytest.mark.parametrize("b,d", [(1, 64), (3, 2048), (33, 160), (33, 320)])
def test_drop_nonfinite_kernel(device, b, d):
    positions = (torch.arange(b, dtype=torch.int64) * 7 + 3).to(device)
    h = hiddens(b, d, device)
    h[0, 0, :4] = torch.tensor([BF16_MAX, -BF16_MAX, 1e-40, -0.0])  # extremes that are finite
    assert torch.equal(drop(positions, h), positions)
    for row, stream, col in ((0, 0, 0), (b - 1, 3, d - 1), (b // 2, 2, 17)):
        for bad in (float("nan"), float("inf"), float("-inf")):
            bent = h.clone()
            bent[row, stream, col] = bad
            assert drop(positions, bent).tolist() == [DROPPED] * b, (row, stream, col, bad)


@pytest.mark.parametrize("device", DEVICES)
def test_drop_nonfinite_tiles_take_exactly_their_rules_scratch(device, monkeypatch):
    """The tiles' verdicts in a workspace of exactly ``drop_nonfinite_workspace`` bytes, poisoned with
    bad verdicts: each program writes its own (a short rule would allocate instead: refused here)."""
    from draftgraph.runtime.ir.tensor_spec import TensorSpec

    b, d = 6, 1024  # 6 x 4 x 1024 = 24576 values: two tiles, a grid (6 >= DROP_GRID_MIN_ROWS)
    assert b >= NF.DROP_GRID_MIN_ROWS
    specs = [TensorSpec((b,), torch.int64), TensorSpec((b, 4, d), torch.bfloat16)]
    nbytes = NF.drop_nonfinite_workspace(specs, {}, b)
    assert nbytes >= 2 * 4
    assert NF.drop_nonfinite_workspace(specs, {}, NF.DROP_GRID_MIN_ROWS - 1) == 0  # one program: none
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("the workspace was too short: allocated"))
    workspace = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)  # every verdict "bad"
    positions = (torch.arange(b, dtype=torch.int64) * 5).to(device)
    out = torch.full_like(positions, -7)
    h = hiddens(b, d, device)
    for _ in range(2):  # the verdicts of the last call stay in the scratch: each call writes its own
        NF.drop_nonfinite_impl([positions, h], [out], {}, workspace)
        assert torch.equal(out, positions)
    h[b - 1, 3, d - 1] = float("nan")
    NF.drop_nonfinite_impl([positions, h], [out], {}, workspace)
    assert out.tolist() == [DROPPED] * b


@pytest.mark.parametrize("device", DEVICES)
def test_drop_nonfinite_kernel_reads_positions_by_stride(device, monkeypatch):
    """Positions as the chain passes them at B > 1: a column of a [B, F] metadata block (a strided
    view), into a strided out; the kernel takes them (the torch op is never called)."""
    monkeypatch.setattr(NF, "_drop_impl", lambda *a: pytest.fail("the torch op ran instead of the kernel"))
    b = 5
    meta = (torch.arange(b * 6, dtype=torch.int64).reshape(b, 6) * 11).to(device)
    positions = meta[:, 2]
    assert not positions.is_contiguous()
    h = hiddens(b, 64, device)
    block = torch.full((b, 3), -7, dtype=torch.int64, device=device)
    out = block[:, 1]
    NF.drop_nonfinite_impl([positions, h], [out], {}, None)
    assert torch.equal(out, positions)
    assert (block[:, 0] == -7).all() and (block[:, 2] == -7).all()
    h[3, 1, 5] = float("nan")
    NF.drop_nonfinite_impl([positions, h], [out], {}, None)
    assert out.tolist() == [DROPPED] * b
    assert (block[:, 0] == -7).all() and (block[:, 2] == -7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_mark_dropped_kernel_in_place_and_not(device):
    drafts = torch.arange(12, dtype=torch.int64).reshape(3, 4).to(device)
    positions = torch.tensor([5, DROPPED, 9], device=device)
    out = torch.full_like(drafts, -7)
    NF.mark_dropped_impl([drafts, positions], [out], {}, None)
    want = drafts.clone()
    want[1] = NONFINITE
    assert torch.equal(out, want)
    NF.mark_dropped_impl([drafts, positions], [drafts], {}, None)  # in place, as the chain plans it
    assert torch.equal(drafts, want)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_drop_nonfinite_kernel_captured_reads_each_replays_hiddens():
    b = 32
    positions = torch.arange(b, dtype=torch.int64, device="cuda")
    h = hiddens(b, 1024, "cuda")
    out = drop(positions, h)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        NF.drop_nonfinite_impl([positions, h], [out], {}, None)
    for bad in (float("nan"), float("inf"), float("-inf")):
        h[b - 1, 3, 1023] = bad
        graph.replay()
        assert out.tolist() == [DROPPED] * b, bad
    h[b - 1].fill_(BF16_MAX)
    graph.replay()
    assert torch.equal(out, positions)
