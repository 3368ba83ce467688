"""fp8_round_rows (ops/triton/fp8_round.py) against the torch rounding it replaces, bit for bit.

Without CUDA the kernel runs under Triton's CPU interpreter; the ``cuda``-marked cases run it
compiled (where ``(y + 2^23) - 2^23`` must survive the compiler for ties to round to even).
"""

from __future__ import annotations

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import HAS_CUDA, INTERPRET, load_kernel_modules

K = load_kernel_modules(["_common", "fp8_round"])
R = K["fp8_round"]

from draftgraph.runtime.errors import InputError  # noqa: E402
from draftgraph.runtime.model.quant import fp8_round_activations  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRET, reason="the interpreter tests run where there is no CUDA")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEVICES = [pytest.param("cpu", marks=cpu_only), pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def hard_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """float64 rows over magnitudes 2^-30 .. 2^30 with the rounding's edge cases planted: a zero row
    (the amax floor), a tiny row, -0, the saturation edge, and e4m3 ties in the normal and the
    subnormal range (each run's amax pinned to 448 so that the scale is 1 and the ties stay ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 31, (rows, 1), generator=g).double())
    x[0] = 0.0
    x[1] = x[1] * 1e-12
    x[2, :8] = torch.tensor([448.0, 464.0 - 1e-9, 416.0, 432.0, -448.0, 1e-3, -0.0, 1e-30], dtype=torch.float64)
    ties = torch.tensor([1.0625, 1.1875, -1.3125, 17.0, 2**-9 * 1.5, 2**-9 * 2.5, -(2**-9) * 0.5, 2**-7 * 1.0625])
    for run in range(0, cols - 128 + 1, 128):
        x[3, run] = 448.0
        x[3, run + 1 : run + 1 + len(ties)] = ties.double()
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(8, 512), (5, 300), (2, 3, 192), (1, 4096 + 640)])
def test_fp8_round_rows_is_the_torch_rounding_bit_for_bit(device, dtype, shape):
    """Every shape the chain rounds: whole rows, a ragged last run (300: 128 + 128 + 44, padded
    with zeros as the reference pads), groups of 192 rounded apart (the attention's o per group),
    and a row wider than one program (RUNS runs of 128)."""
    rows = 1
    for s in shape[:-1]:
        rows *= s
    x = hard_rows(max(rows, 4), shape[-1], seed=7)[-rows:].reshape(shape)  # one row: the ties row
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    x = x.to(dtype).to(device)
    want = fp8_round_activations(x.cpu())
    out = R.fp8_round_rows(x)
    assert out.shape == x.shape and out.dtype == dtype
    got = out.cpu()
    bad = (got.view(INT_VIEW[dtype]) != want.view(INT_VIEW[dtype])).sum().item()
    assert bad == 0, f"{bad} values differ from fp8_round_activations; first {(got - want).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_round_rows_in_place_and_into_a_given_buffer(device):
    """``out=x`` rounds in place (the MoE's act rows between w13 and w2), ``out=buf`` writes there."""
    x = hard_rows(6, 256, seed=11).to(torch.bfloat16).to(device)
    want = fp8_round_activations(x.cpu())
    buf = torch.full_like(x, float("nan"))
    assert R.fp8_round_rows(x, out=buf) is buf and torch.equal(buf.cpu(), want)
    assert R.fp8_round_rows(x, out=x) is x and torch.equal(x.cpu(), want)
    # rounding twice changes nothing: the values are on the grid of their own runs' scales
    assert torch.equal(R.fp8_round_rows(x).cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_round_rows_reads_and_writes_rows_views(device):
    """A 2-D view of wider rows (the chain's rows views of [B, C, D] buffers) in and out, the
    columns past the view untouched."""
    wide = hard_rows(4, 384, seed=12).to(torch.bfloat16).to(device)
    dst = torch.full((4, 400), 7.0, dtype=torch.bfloat16, device=device)
    R.fp8_round_rows(wide[:, :256], out=dst[:, 16:272])
    assert torch.equal(dst[:, 16:272].cpu(), fp8_round_activations(wide[:, :256].cpu()))
    assert (dst[:, :16] == 7).all() and (dst[:, 272:] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_round_rows_of_no_rows_writes_nothing(device):
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=device)
    assert R.fp8_round_rows(x).shape == (0, 256)


@pytest.mark.parametrize(
    "x,out,match",
    [
        (torch.ones(4, 8, 256, dtype=torch.bfloat16).transpose(0, 1), None, "contiguous"),
        (torch.ones(4, 256, dtype=torch.bfloat16).t(), None, "contiguous"),
        (torch.ones(4, 256, dtype=torch.int32), None, "bf16 / fp16 / fp32"),
        (torch.tensor(1.0), None, ">= 1 dim"),
        (torch.ones(4, 256, dtype=torch.bfloat16), torch.empty(4, 128, dtype=torch.bfloat16), r"\(4, 256\)"),
        (torch.ones(4, 256, dtype=torch.bfloat16), torch.empty(4, 256), "bfloat16"),
    ],
)
def test_fp8_round_rows_refuses_what_it_cannot_round(x, out, match):
    """A typed error naming what was expected, before any launch; ``out`` is left as it was."""
    before = None if out is None else out.clone()
    with pytest.raises(InputError, match=match):
        R.fp8_round_rows(x, out=out)
    if out is not None:
        assert torch.equal(out.nan_to_num(), before.nan_to_num())
