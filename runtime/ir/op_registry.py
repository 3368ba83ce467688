"""OpDef and the one op registry.

An op is data: a shape/dtype rule, which outputs may share an input's bytes
(``inplace``) or are views of it (``views``), which inputs it mutates (state),
how much scratch it needs (``workspace``), and implementations. The torch
implementation is the reference and the CPU path; a fused implementation (e.g.
Triton) may be registered per device type and is selected at bind time.

An op may leave its implementation to the graph's user: ``bound_by`` names the attr whose
value is the key of the object the executor is given for it (the ``body``'s runner). Such a
node may instead carry a subgraph as its implementation, which ``flatten`` inlines.

Implementation contract (what makes capture safe and memory planned):
``impl(inputs, outputs, attrs, workspace) -> None`` writes every output in place
(out= semantics) into the views it is given, never rebinds them, returns
``None``, and never syncs with the host (no ``.item()``, no branching on tensor
values). ``workspace`` is a uint8 tensor of the declared size, or ``None``.
An output declared ``inplace`` with input ``i`` may or may not alias input
``i``: the implementation must be correct either way. Outputs listed in
``deferred`` may be finished on the executor's side stream (``draftgraph.ops.overlap``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from draftgraph.runtime.errors import GraphError
from draftgraph.runtime.ir.tensor_spec import TensorSpec

ShapeRule = Callable[[Sequence[TensorSpec], Mapping[str, Any]], Sequence[TensorSpec]]
Impl = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Mapping[str, Any], "torch.Tensor | None"], None]
WorkspaceRule = Callable[[Sequence[TensorSpec], Mapping[str, Any], int], int]
ViewFn = Callable[[torch.Tensor, Mapping[str, Any], tuple[int, ...]], torch.Tensor]


class ShapeRuleError(GraphError):
    """Raised by a shape/dtype rule; validate() adds the node and its neighbours."""


@dataclass(frozen=True)
class OpDef:
    """The definition of one op. See the module docstring for the contract."""

    name: str
    family: str  # colour group in pictures: embed, norm, linear, mhc, attention, moe, head, sample, ...
    infer: ShapeRule
    impl: Impl
    output_names: tuple[str, ...] = ("out",)
    inplace: Mapping[int, int] = field(default_factory=dict)  # output -> input it may overwrite (on may_reuse)
    views: Mapping[int, int] = field(default_factory=dict)  # output index -> input index
    view_fn: ViewFn | None = None  # builds the view output from the input tensor
    mutates: tuple[int, ...] = ()  # input indices written in place (state)
    workspace: WorkspaceRule | None = None  # bytes of scratch for a concrete batch
    deferred: tuple[int, ...] = ()  # outputs a side_stream() block may still write after the step (ops.overlap)
    fused: dict[str, Impl] = field(default_factory=dict)  # device type -> implementation (register_fused)
    bound_by: str | None = None  # attrs[bound_by] keys the implementation the executor is given (a runner)
    doc: str = ""

    def workspace_bytes(self, specs: Sequence[TensorSpec], attrs: Mapping[str, Any], batch: int) -> int:
        return 0 if self.workspace is None else int(self.workspace(specs, attrs, batch))

    def select_impl(self, device: torch.device, use_fused: bool = True) -> Impl:
        if use_fused and device.type in self.fused:
            return self.fused[device.type]
        return self.impl


_REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in _REGISTRY and _REGISTRY[op.name] is not op:
        raise GraphError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    return op


def register_fused(op_name: str, device_type: str, impl: Impl) -> None:
    """Attach a fused implementation (selected at bind time on ``device_type``).

    To the registered OpDef itself (its ``fused`` mapping), not to a copy put in its place:
    ``ops.<module>.<OP>`` stays the object ``get_op`` returns on every device. (A copy once made
    a monkeypatch of ``draftgraph.ops.combiner.COMBINER.impl`` silently miss the CUDA path.)
    """
    get_op(op_name).fused[device_type] = impl


def get_op(name: str) -> OpDef:
    if name not in _REGISTRY:
        raise GraphError(
            f"op: expected one of {sorted(_REGISTRY)}, got {name!r} "
            "(hint: import the module that registers it; `import draftgraph` registers the built-in ops)"
        )
    return _REGISTRY[name]


def has_op(name: str) -> bool:
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


# ---- helpers for shape rules -------------------------------------------------


def expect(cond: bool, what: str, expected: object, got: object) -> None:
    """Raise ShapeRuleError("what: expected X, got Y") unless ``cond``."""
    if not cond:
        raise ShapeRuleError(f"{what}: expected {expected}, got {got}")


def expect_count(specs: Sequence[TensorSpec], n: int, op: str) -> None:
    expect(len(specs) == n, f"{op} inputs", f"{n} inputs", f"{len(specs)}")


def expect_dtype(spec: TensorSpec, dtypes: torch.dtype | tuple[torch.dtype, ...], what: str) -> None:
    allowed = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    names = " or ".join(TensorSpec((), d).short()[:-2] for d in allowed)
    expect(spec.dtype in allowed, f"{what} dtype", names, spec.short())


def expect_rank(spec: TensorSpec, rank: int, what: str) -> None:
    expect(len(spec.shape) == rank, f"{what} rank", f"{rank} dims", spec.short())
