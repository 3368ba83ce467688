"""``body``: the draft step's body, the V4 block (spec section 2, "Block").

Inputs (streams [B, C, D], positions, kv_start, block_table, $kv_cache); output: the body's
streams [B, C, D]; it writes the KV cache. The op has no implementation of its own: a node
either carries the V4 block as its subgraph (``runner=builtin``; ``flatten`` inlines it) or is
run by the DraftRunner the executor is given under ``attrs["runner"]`` (the seed's
circuit-draft binding). ``attrs["workspace_bytes"]`` is the runner's declared scratch.
"""

from __future__ import annotations

from draftgraph.runtime.errors import ExecutionError
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, register


def _infer(specs, attrs):
    expect_count(specs, 5, "body")
    expect(len(specs[0].shape) == 3, "body streams", "[B, C, D]", specs[0].short())
    return [specs[0]]


def _unbound(inputs, outputs, attrs, workspace):
    raise ExecutionError(f"body runner {attrs.get('runner')!r} is not bound (hint: set_circuit_draft)")


BODY = register(
    OpDef(
        name="body",
        family="runner",
        infer=_infer,
        impl=_unbound,
        mutates=(4,),
        workspace=lambda specs, attrs, batch: int(attrs.get("workspace_bytes", 0)),
        bound_by="runner",
        doc="The V4 block: its subgraph, or the runner bound under attrs['runner'].",
    )
)
