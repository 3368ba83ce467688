"""The CPU tests' skip of the Triton interpreter's repeated patching (interpreter_speed.py): in
place wherever the tests interpret, work independent of how often a kernel calls its helpers, and
the same results."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU tests' interpreter only")


@triton.jit
def _row_total(x_ptr, row, N: tl.constexpr):
    return tl.sum(tl.load(x_ptr + row * N + tl.arange(0, N)), 0)  # tl.sum: a helper naming triton.language.core


@triton.jit
def _totals_kernel(x_ptr, out_ptr, N: tl.constexpr, ROWS: tl.constexpr):
    for r in tl.static_range(ROWS):
        tl.store(out_ptr + r, _row_total(x_ptr, r, N))


def _patches_for(monkeypatch, rows: int) -> int:
    from triton.runtime import interpreter

    calls = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(1) or real(*a))
    x = torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16)
    out = torch.empty(rows)
    _totals_kernel[(1,)](x, out, 16, rows)
    assert torch.equal(out, x.sum(1))
    monkeypatch.undo()
    return len(calls)


def test_the_skip_is_installed_where_the_tests_interpret():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "skips_repeats", False)  # else the CPU suite runs ~2x slower


def test_the_patching_does_not_grow_with_helper_calls(monkeypatch):
    _patches_for(monkeypatch, 1)  # the first launch in a process: triton.language's imports may still change
    assert _patches_for(monkeypatch, 2) == _patches_for(monkeypatch, 12)  # unskipped: 24 and 124
