"""``body_runner``: the draft step's body as one node run by an external DraftRunner.

Inputs (streams [B, C, D], positions, kv_start, block_table, $kv_cache); output:
streams [B, C, D]. The executor binds the runner object by ``attrs["runner"]``;
the op's own implementation only refuses to run unbound.
"""

from __future__ import annotations

from draftgraph.runtime.errors import ExecutionError
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, register


def _infer(specs, attrs):
    expect_count(specs, 5, "body_runner")
    expect(len(specs[0].shape) == 3, "body_runner streams", "[B, C, D]", specs[0].short())
    return [specs[0]]


def _unbound(inputs, outputs, attrs, workspace):
    raise ExecutionError(f"body_runner {attrs.get('runner')!r} has no runner bound (hint: set_circuit_draft)")


BODY_RUNNER = register(
    OpDef(
        name="body_runner",
        family="runner",
        infer=_infer,
        impl=_unbound,
        mutates=(4,),
        workspace=lambda specs, attrs, batch: int(attrs.get("workspace_bytes", 0)),
    )
)
