"""drop_nonfinite and mark_dropped: a batch whose hiddens are not all finite drafts nothing, writes nothing.

The target's hidden is the one input of a chain a caller computes on the device; one NaN in it
would go through the step into the drafter cache and poison the window of every later draft.
The check runs inside the chain, with no host sync:

- ``drop_nonfinite(positions, hidden)``: when any row's hidden holds a NaN or an infinity, every
  row gets the position ``DROPPED`` (far below 0, and below 0 still after any step's offset):
  the proposer refuses the whole call, so no row of it may take effect. A row at a negative
  position is dead to the attention: its own slot does not exist, so it writes no cache row
  and reads no key (ops/attention.py), at every step of the chain.
- ``mark_dropped(drafts, positions)``: every draft of a dropped row becomes ``NONFINITE``, so the
  one device-to-host read of the drafts also says that the proposer must refuse the call.
"""

from __future__ import annotations

import torch
from draftgraph.ops import constants
from draftgraph.ops.v4_shapes import batch_of, expect_spec
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec

NONFINITE = -2  # the token id of every draft of a row whose hidden is not finite
DROPPED = -(1 << 40)  # the position of such a row


def finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """bool [R]: whether each row of ``rows`` [R, N] holds no NaN and no infinity.

    x * 0 is 0 for every finite x and NaN for a NaN or an infinity, so a product with a zero
    vector is 0 exactly on the finite rows: one GEMV reading the rows once (cuBLAS on CUDA),
    and a compare, where ``isfinite(rows).all(1)`` is five kernels (abs, ne, eq, and, all).
    """
    return torch.mv(rows, constants.full(rows.shape[1], 0.0, rows.dtype, rows.device)) == 0


def _drop_infer(specs, attrs):
    expect_count(specs, 2, "drop_nonfinite")
    positions, hidden = specs
    b = batch_of(positions, "drop_nonfinite positions")
    expect_spec(positions, (b,), torch.int64, "drop_nonfinite positions")
    expect(len(hidden.shape) >= 2 and hidden.shape[0] == b, "drop_nonfinite hidden", "[B, ...]", hidden.short())
    return [TensorSpec((b,), torch.int64)]


def _drop_impl(inputs, outputs, attrs, workspace):
    positions, hidden = inputs
    finite = finite_rows(hidden.reshape(1, -1))  # [1]: the whole batch, or none of it
    torch.where(finite, positions, constants.full(1, DROPPED, torch.int64, positions.device), out=outputs[0])


DROP_NONFINITE = register(
    OpDef(
        name="drop_nonfinite",
        family="sample",
        infer=_drop_infer,
        impl=_drop_impl,
        doc="every position becomes DROPPED (the rows are dead) when some row's hidden is not finite.",
    )
)


def _mark_infer(specs, attrs):
    expect_count(specs, 2, "mark_dropped")
    drafts, positions = specs
    b = batch_of(drafts, "mark_dropped drafts")
    expect(len(drafts.shape) == 2, "mark_dropped drafts", "i64[B, K]", drafts.short())
    expect_spec(drafts, (b, drafts.shape[1]), torch.int64, "mark_dropped drafts")
    expect_spec(positions, (b,), torch.int64, "mark_dropped positions")
    return [drafts]


def _mark_impl(inputs, outputs, attrs, workspace):
    drafts, positions = inputs
    dropped = positions.unsqueeze(1) == DROPPED  # [B, 1]
    torch.where(dropped, constants.full(1, NONFINITE, torch.int64, drafts.device), drafts, out=outputs[0])


MARK_DROPPED = register(
    OpDef(
        name="mark_dropped",
        family="sample",
        infer=_mark_infer,
        impl=_mark_impl,
        inplace={0: 0},
        doc="drafts of dropped rows (position DROPPED) become NONFINITE (-2).",
    )
)
