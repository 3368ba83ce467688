"""Shape-rule helpers shared by the V4 ops: one exact check per input.

A rule states each input's full shape and dtype; the message prints both as the
printer does (``bf16[B,256]``), so a wrong wire reads as expected vs got.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from draftgraph.runtime.ir.op_registry import expect
from draftgraph.runtime.ir.tensor_spec import B, Dim, TensorSpec, dtype_name

ACTIVATIONS = (torch.bfloat16, torch.float32, torch.float16)


def expect_spec(
    spec: TensorSpec,
    shape: Sequence[Dim],
    dtypes: torch.dtype | tuple[torch.dtype, ...],
    what: str,
) -> None:
    """Raise ShapeRuleError unless ``spec`` is exactly ``shape`` with one of ``dtypes``."""
    allowed = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    names = "|".join(dtype_name(d) for d in allowed)
    expected = f"{names}[{','.join(str(d) for d in shape)}]"
    expect(tuple(spec.shape) == tuple(shape) and spec.dtype in allowed, what, expected, spec.short())


def batch_of(spec: TensorSpec, what: str) -> Dim:
    """The leading (batch) dim of an activation: ``B`` in graphs, an int in concrete checks."""
    expect(len(spec.shape) >= 1, f"{what} rank", "a leading batch dim", spec.short())
    return spec.shape[0]


def require_attrs(attrs: Mapping[str, Any], names: Sequence[str], op: str) -> None:
    missing = [n for n in names if n not in attrs]
    expect(not missing, f"{op} attrs", f"{list(names)}", f"missing {missing}")


__all__ = ["ACTIVATIONS", "B", "batch_of", "expect_spec", "require_attrs"]
