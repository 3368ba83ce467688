"""Confidence-gated drafting: draft_gate and cut_drafts.

With a confidence threshold tau the K-draft chain stops once every live row's
chain confidence (the min top-1 probability of its drafts so far) is below tau.
A row's draft k (k >= 1) is kept while all of its drafts 0..k-1 had prob >= tau:
the draft that drops below tau is still proposed (it is already computed, and the
verifier decides), the ones after it are not.

``draft_gate`` before step k turns prob_{k-1} into ``alive_k`` (per row) and
``go_k`` (int32 [1]: some live row is still alive). The executor runs step k
only where go_k is nonzero: eagerly by reading it, captured by a CUDA conditional
IF node reading it at replay time (runtime/execution/conditional.py). Padded rows
(kv_start 1 > position 0, see runtime/cache/metadata.py) never keep the chain going.

``cut_drafts`` writes -1 over every draft that is not kept, so the one
device-to-host read of the drafts also says how many each row has. A skipped
step leaves stale bytes in its token and prob buffers; only cut positions can
hold them, because a step is skipped only when no live row is alive for it.
"""

from __future__ import annotations

import torch
from draftgraph.ops.v4_shapes import batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec

F32, I32, I64 = torch.float32, torch.int32, torch.int64
CUT = -1  # the token id of a draft that was not kept


# ---- draft_gate ------------------------------------------------------------------


def _gate_infer(specs, attrs):
    expect(len(specs) in (3, 4), "draft_gate inputs", "3 (prob, positions, kv_start) or 4 (+ alive)", len(specs))
    require_attrs(attrs, ("tau",), "draft_gate")
    prob, positions, kv_start = specs[:3]
    b = batch_of(prob, "draft_gate prob")
    expect_spec(prob, (b,), F32, "draft_gate prob")
    expect_spec(positions, (b,), I64, "draft_gate positions")
    expect_spec(kv_start, (b,), I32, "draft_gate kv_start")
    if len(specs) == 4:
        expect_spec(specs[3], (b,), I32, "draft_gate alive")
    expect(0.0 < float(attrs["tau"]) <= 1.0, "draft_gate tau", "in (0, 1]", attrs["tau"])
    return [TensorSpec((b,), I32), TensorSpec((1,), I32)]


def _gate_impl(inputs, outputs, attrs, workspace):
    prob, positions, kv_start = inputs[:3]
    alive, go = outputs
    keep = prob >= float(attrs["tau"])  # NaN compares false: a NaN confidence stops the row
    if len(inputs) == 4:
        keep &= inputs[3].bool()
    alive.copy_(keep)
    live = kv_start <= positions  # a padded row has kv_start 1 > position 0
    go.copy_((keep & live).any().view(1))


DRAFT_GATE = register(
    OpDef(
        name="draft_gate",
        family="sample",
        infer=_gate_infer,
        impl=_gate_impl,
        output_names=("alive", "go"),
        doc="alive = prob >= tau (and alive before); go = any live row alive: whether the next step runs.",
    )
)


# ---- cut_drafts ------------------------------------------------------------------


def _cut_infer(specs, attrs):
    expect(len(specs) >= 3 and len(specs) % 2 == 1, "cut_drafts inputs",
           "drafts then (alive, go) for every step after the first", len(specs))
    drafts = specs[0]
    b = batch_of(drafts, "cut_drafts drafts")
    k = len(specs) // 2 + 1
    expect_spec(drafts, (b, k), I64, "cut_drafts drafts")
    for i in range(1, k):
        expect_spec(specs[2 * i - 1], (b,), I32, f"cut_drafts alive {i}")
        expect_spec(specs[2 * i], (1,), I32, f"cut_drafts go {i}")
    return [drafts]


def _cut_impl(inputs, outputs, attrs, workspace):
    drafts, (out,) = inputs[0], outputs
    alive = torch.stack(inputs[1::2], dim=1)  # [B, K-1]: row alive for draft k
    ran = torch.cat(inputs[2::2]).view(1, -1)  # [1, K-1]: step k ran
    if out.data_ptr() != drafts.data_ptr():  # planned in place as a rule: no copy then
        out.copy_(drafts)
    out[:, 1:].masked_fill_((alive == 0) | (ran == 0), CUT)  # the first draft is always kept


CUT_DRAFTS = register(
    OpDef(
        name="cut_drafts",
        family="sample",
        infer=_cut_infer,
        impl=_cut_impl,
        inplace={0: 0},
        doc="drafts with -1 wherever the row stopped (confidence below tau) or the step did not run.",
    )
)
