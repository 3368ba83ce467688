"""Basic ops: linear, add, mul, rms_norm, softmax, argmax, reshape.

Each torch implementation writes into its output views (out= semantics) and
computes in fp32 where the spec says so ("vanilla" RMS norm: w * x / rms).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from draftgraph.ops.quantised import linear_t
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_dtype, register
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec

FLOATS = (torch.bfloat16, torch.float32, torch.float16, torch.float64)


def _broadcastable(small: tuple, big: tuple) -> bool:
    if len(small) > len(big):
        return False
    return all(s in (1, b) for s, b in zip(small[::-1], big[::-1]))


# ---- linear ------------------------------------------------------------------


def _linear_infer(specs, attrs):
    expect_count(specs, 2, "linear")
    x, w = specs
    out_features, in_features = w.logical_shape[-2:] if len(w.shape) == 2 else (None, None)
    expect(len(w.shape) == 2, "linear weight rank", "[out, in]", w.short())
    expect(x.shape[-1] == in_features, "linear in features", f"x[..., {in_features}]", x.short())
    if w.is_quantised:  # FP8 / MXFP4 weight (ops/quantised.py): bf16 activations
        expect(x.dtype == torch.bfloat16, "linear input dtype", f"bf16 with a {w.quant} weight", x.short())
    else:
        expect(x.dtype == w.dtype, "linear dtypes", f"x and weight both {w.short()[:-2]}", x.short())
    expect_dtype(x, FLOATS, "linear input")
    return [TensorSpec((*x.shape[:-1], out_features), x.dtype)]


def _linear_impl(inputs, outputs, attrs, workspace):
    x, w = inputs
    (out,) = outputs
    linear_t(x.reshape(-1, x.shape[-1]), w, attrs, out=out.view(-1, out.shape[-1]))


LINEAR = register(
    OpDef(
        name="linear",
        family="linear",
        infer=_linear_infer,
        impl=_linear_impl,
        doc="y = x @ W^T, W [out, in]; bf16 or block-scaled FP8/MXFP4 weights (fp32 accumulate), fp32 for the mHC fns.",
    )
)


# ---- elementwise -------------------------------------------------------------


def _binary_infer(name):
    def infer(specs, attrs):
        expect_count(specs, 2, name)
        a, b = specs
        expect(_broadcastable(b.shape, a.shape), f"{name} shapes", f"b broadcastable to {a.short()}", b.short())
        expect(a.dtype == b.dtype, f"{name} dtypes", a.short()[: a.short().index("[")], b.short())
        return [a]

    return infer


def _add_impl(inputs, outputs, attrs, workspace):
    torch.add(inputs[0], inputs[1], out=outputs[0])


def _mul_impl(inputs, outputs, attrs, workspace):
    torch.mul(inputs[0], inputs[1], out=outputs[0])


ADD = register(
    OpDef(name="add", family="elementwise", infer=_binary_infer("add"), impl=_add_impl, inplace={0: 0})
)
MUL = register(
    OpDef(name="mul", family="elementwise", infer=_binary_infer("mul"), impl=_mul_impl, inplace={0: 0})
)


# ---- rms_norm ----------------------------------------------------------------


def _rms_norm_infer(specs, attrs):
    expect_count(specs, 2, "rms_norm")
    x, w = specs
    expect(w.shape == (x.shape[-1],), "rms_norm weight", f"[{x.shape[-1]}]", w.short())
    expect_dtype(x, FLOATS, "rms_norm input")
    return [x]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, fp32 math, in x's dtype ("vanilla": w, not 1 + w).

    ``F.rms_norm`` is one fused kernel on CUDA (fp32 math inside for bf16, one rounding
    at the end) and the same fp32 composite on CPU; it falls back to the composite
    when x and weight differ in dtype, so a mixed pair is widened to fp32 first.
    """
    if weight is not None and weight.dtype != x.dtype:
        return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor) -> None:
    """``out = rms_norm(x, weight, eps)``; the result exists before ``out`` is written, so ``out`` may alias ``x``."""
    out.copy_(rms_norm(x, weight, eps))


def _rms_norm_impl(inputs, outputs, attrs, workspace):
    rms_norm_into(inputs[0], inputs[1], attrs["eps"], outputs[0])


RMS_NORM = register(
    OpDef(
        name="rms_norm",
        family="norm",
        infer=_rms_norm_infer,
        impl=_rms_norm_impl,
        inplace={0: 0},
        doc="y = w * x / sqrt(mean(x^2) + eps) over the last dim, fp32 math.",
    )
)


# ---- softmax / argmax --------------------------------------------------------


def _softmax_infer(specs, attrs):
    expect_count(specs, 1, "softmax")
    expect_dtype(specs[0], FLOATS, "softmax input")
    return [specs[0]]


def _softmax_impl(inputs, outputs, attrs, workspace):
    outputs[0].copy_(torch.softmax(inputs[0].float(), dim=-1))


SOFTMAX = register(
    OpDef(name="softmax", family="elementwise", infer=_softmax_infer, impl=_softmax_impl, inplace={0: 0})
)


def _argmax_infer(specs, attrs):
    expect_count(specs, 1, "argmax")
    expect_dtype(specs[0], FLOATS, "argmax input")
    return [TensorSpec(specs[0].shape[:-1], torch.int64)]


def _argmax_impl(inputs, outputs, attrs, workspace):
    torch.argmax(inputs[0], dim=-1, out=outputs[0])


ARGMAX = register(OpDef(name="argmax", family="sample", infer=_argmax_infer, impl=_argmax_impl))


# ---- reshape (a view) ----------------------------------------------------------


def _reshape_infer(specs, attrs):
    expect_count(specs, 1, "reshape")
    (x,) = specs
    shape = tuple(attrs["shape"])
    # Compare element counts with B factored out: both sides must carry B the same way.
    expect(shape.count(B) == x.shape.count(B), "reshape batch dim", f"{x.shape.count(B)} B", shape)
    fixed = lambda dims: math.prod(d for d in dims if d != B)  # noqa: E731
    expect(fixed(shape) == fixed(x.shape), "reshape numel", f"{fixed(x.shape)} per batch row", shape)
    return [TensorSpec(shape, x.dtype)]


def _reshape_view(x: torch.Tensor, attrs, shape: tuple[int, ...]) -> torch.Tensor:
    return x.view(shape)


def _reshape_impl(inputs, outputs, attrs, workspace):
    # A view output aliases its input: nothing to compute. Kept for unaliased runs.
    if outputs[0].data_ptr() != inputs[0].data_ptr():
        outputs[0].copy_(inputs[0].view(outputs[0].shape))


RESHAPE = register(
    OpDef(
        name="reshape",
        family="view",
        infer=_reshape_infer,
        impl=_reshape_impl,
        views={0: 0},
        view_fn=_reshape_view,
    )
)


# ---- stack (gather K per-draft values into one tensor for one device-to-host copy) ----


def _stack_infer(specs, attrs):
    expect(len(specs) >= 1, "stack inputs", ">= 1 input", len(specs))
    first = specs[0]
    for i, s in enumerate(specs):
        expect(s == first, f"stack input {i}", first.short(), s.short())
    return [TensorSpec((*first.shape, len(specs)), first.dtype)]


def _stack_impl(inputs, outputs, attrs, workspace):
    torch.stack(list(inputs), dim=-1, out=outputs[0])


STACK = register(OpDef(name="stack", family="elementwise", infer=_stack_infer, impl=_stack_impl))
