"""draft_gate and cut_drafts, one kernel each (the torch ops take 7 and 6 launches).

Why: a gated chain (draft_conf_tau > 0) runs a gate before every step after the first
and the cut once at the end. At B=1 on the H200 the torch gate cost ~27 us per step
(launches of one-element kernels, plus the conditional node), which is what a gated
chain pays even when no step is skipped. Both ops are a few dozen integers: one
program reads them all.
"""

from __future__ import annotations

import triton
import triton.language as tl
from draftgraph.ops.draft_gate import CUT, _cut_impl
from draftgraph.ops.triton._common import next_pow2, pdl_args, pdl_wait

MAX_CUT_STEPS = 7  # cut_drafts of K <= 8 drafts in one kernel (ProposerOptions.max_num_drafts is 8)
CUT_ID: tl.constexpr = tl.constexpr(CUT)


@triton.jit
def _draft_gate_kernel(prob, positions, kv_start, alive_in, alive, go, tau, B,
                       HAS_ALIVE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.arange(0, BLOCK)
    inside = rows < B
    keep = tl.load(prob + rows, mask=inside, other=0.0) >= tau  # NaN compares false: the row stops
    if HAS_ALIVE:
        keep = keep & (tl.load(alive_in + rows, mask=inside, other=0) != 0)
    tl.store(alive + rows, keep.to(tl.int32), mask=inside)
    # A padded row (kv_start 1 > position 0) never keeps the chain going.
    live = tl.load(kv_start + rows, mask=inside, other=1).to(tl.int64) <= tl.load(positions + rows, mask=inside,
                                                                                   other=0)
    tl.store(go, tl.max((keep & live & inside).to(tl.int32), axis=0))


def draft_gate_impl(inputs, outputs, attrs, workspace):
    prob, positions, kv_start = inputs[:3]
    alive, go = outputs
    b = prob.shape[0]
    alive_in = inputs[3] if len(inputs) == 4 else alive  # not read without HAS_ALIVE
    _draft_gate_kernel[(1,)](prob, positions, kv_start, alive_in, alive, go, float(attrs["tau"]), b,
                             HAS_ALIVE=len(inputs) == 4, BLOCK=max(16, next_pow2(b)), num_warps=1,
                             **pdl_args(prob.device))


@triton.jit
def _cut_column(out, rows, inside, K, step: tl.constexpr, alive, go):
    ran = tl.load(go + rows * 0, mask=inside, other=0) != 0  # [1] broadcast to the rows
    kept = (tl.load(alive + rows, mask=inside, other=0) != 0) & ran
    tl.store(out + rows * K + step, tl.full(rows.shape, CUT_ID, tl.int64), mask=inside & ~kept)


@triton.jit
def _cut_drafts_kernel(drafts, out, B, K, a1, g1, a2, g2, a3, g3, a4, g4, a5, g5, a6, g6, a7, g7,
                       STEPS: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.arange(0, BLOCK)
    inside = rows < B
    if COPY:  # planned in place as a rule: no copy then
        for k in tl.static_range(STEPS + 1):
            tl.store(out + rows * K + k, tl.load(drafts + rows * K + k, mask=inside), mask=inside)
    # The first draft is always kept; draft k is cut where its row was not alive or step k did not run.
    if STEPS >= 1:
        _cut_column(out, rows, inside, K, 1, a1, g1)
    if STEPS >= 2:
        _cut_column(out, rows, inside, K, 2, a2, g2)
    if STEPS >= 3:
        _cut_column(out, rows, inside, K, 3, a3, g3)
    if STEPS >= 4:
        _cut_column(out, rows, inside, K, 4, a4, g4)
    if STEPS >= 5:
        _cut_column(out, rows, inside, K, 5, a5, g5)
    if STEPS >= 6:
        _cut_column(out, rows, inside, K, 6, a6, g6)
    if STEPS >= 7:
        _cut_column(out, rows, inside, K, 7, a7, g7)


def cut_drafts_impl(inputs, outputs, attrs, workspace):
    drafts, (out,) = inputs[0], outputs
    b, k = drafts.shape
    steps = k - 1
    if steps > MAX_CUT_STEPS or not (drafts.is_contiguous() and out.is_contiguous()):
        _cut_impl(inputs, outputs, attrs, workspace)
        return
    pairs = list(inputs[1:]) + [drafts, drafts] * (MAX_CUT_STEPS - steps)  # unused slots: never read
    _cut_drafts_kernel[(1,)](drafts, out, b, k, *pairs, STEPS=steps, COPY=out.data_ptr() != drafts.data_ptr(),
                             BLOCK=max(16, next_pow2(b)), num_warps=1, **pdl_args(drafts.device))


__all__ = ["cut_drafts_impl", "draft_gate_impl"]
