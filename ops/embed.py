"""embed: the token embedding row gather, by a device index tensor (no host sync)."""

from __future__ import annotations

import torch
from draftgraph.ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec
from draftgraph.runtime.ir.op_registry import OpDef, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec


def _embed_infer(specs, attrs):
    expect_count(specs, 2, "embed")
    token, table = specs
    b = batch_of(token, "embed token")
    expect_spec(token, (b,), torch.int64, "embed token")
    expect_rank(table, 2, "embed table [V, D]")
    expect_spec(table, table.shape, ACTIVATIONS, "embed table")
    return [TensorSpec((b, table.shape[1]), table.dtype)]


def _embed_impl(inputs, outputs, attrs, workspace):
    token, table = inputs  # [B], [V, D]
    # A token outside [0, V) is the caller's bug, checked on the host before staging.
    torch.index_select(table, 0, token, out=outputs[0])  # [B, D]


EMBED = register(
    OpDef(
        name="embed",
        family="embed",
        infer=_embed_infer,
        impl=_embed_impl,
        doc="out[b] = table[token[b]]: token i64[B], table [V, D] -> [B, D].",
    )
)
