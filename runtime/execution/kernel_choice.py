"""Which implementation of an op a bound graph runs: fused, torch, or torch compiled per op.

- ``auto``: the fused kernel registered for the device type (Triton on CUDA), else the torch op.
- ``torch``: the torch op, the reference (baselines, bisection, the CPU path).
- ``compiled``: the torch op compiled by ``torch.compile`` (inductor, no cudagraphs), one op at a
  time. The runtime still owns every byte (outputs are the planned arena views) and still
  captures the whole chain; inductor only fuses each op's elementwise chains (RMS norms, the
  Sinkhorn loop, RoPE, the argmax mask) into a few generated kernels. The first run of each
  (op, shapes) compiles it, so warm-up, not the captured replay, pays that time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.ir.op_registry import Impl, OpDef
from draftgraph.runtime.ir.tensor_spec import TensorSpec

KERNELS = ("auto", "torch", "compiled")
# Ops whose torch implementation is already one library call (or a view): nothing to fuse.
NOT_COMPILED = frozenset({"add", "embed", "linear", "minimum", "mul", "offset_positions", "reshape"})
# Long elementwise chains (the Sinkhorn loop written out, ~700 nodes) fuse into one kernel
# instead of one per 64 nodes (inductor's default).
INDUCTOR_OPTIONS = {"max_fusion_size": 4096}
_compiled: dict[str, Impl] = {}
_compiled_in_place: dict[str, Impl] = {}


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise InputError(describe("kernels", " or ".join(repr(k) for k in KERNELS), repr(kernels)))
    return kernels


def select_impl(op: OpDef, device: torch.device, kernels: str, input_specs: Sequence[TensorSpec] = ()) -> Impl:
    """The implementation a step of ``op`` runs; ``input_specs`` are the node's inputs' specs."""
    if kernels != "auto":
        return op.impl  # "torch", and "compiled" before compiled_step() binds the step
    fused = op.select_impl(device, use_fused=True)
    if fused is op.impl or not reads_block_scaled(input_specs):
        return fused
    # A node reading a block-scaled (FP8 / MXFP4) weight takes the fused impl only where its
    # kernels read those formats, which the impl says through ``unsupported_block_scaled(specs)``
    # (the reason, or None): FP8 linears (linear, combiner, swa_attention with all five FP8) and
    # MXFP4 routed experts with an FP8 shared expert (moe, moe_hash; moe_shard too, whose shared
    # expert only rank 0 holds), ops/triton. Everything else runs the torch op, which dequantises
    # the blocks it reads (ops/quantised.py): impls without the rule (their kernels read bf16
    # weights only), an MXFP4 linear (no MXFP4 GEMV kernel), FP8 routed experts (the "fp8"
    # checkpoint format: no FP8 expert kernel), an attention with mixed formats. A node with bf16
    # weights only (moe_shard's bf16 experts included) takes the fused impl whenever one is
    # registered; at run time each fused impl still hands inputs its kernels do not cover (odd
    # dtypes or strides, batch over the MoE's MAX_BATCH) to its torch op.
    return fused if block_scaled_gap(fused, input_specs) is None else op.impl


def reads_block_scaled(input_specs: Sequence[TensorSpec]) -> bool:
    """Whether any input is a weight kept in a block-scaled format (its spec carries ``quant``)."""
    return any(spec.is_quantised for spec in input_specs)


def block_scaled_gap(impl: Impl, input_specs: Sequence[TensorSpec]) -> str | None:
    """Why ``impl`` cannot read the block-scaled inputs among ``input_specs``, or None when it can.

    Example
    -------
    >>> block_scaled_gap(get_op("linear").fused["cuda"], [x_spec, fp8_weight_spec]) is None
    True
    """
    rule = getattr(impl, "unsupported_block_scaled", None)
    if rule is None:
        return "its kernels read bf16 weights only" if reads_block_scaled(input_specs) else None
    return rule(input_specs) if reads_block_scaled(input_specs) else None


def compiled_step(op: OpDef, inputs: list, outputs: list) -> tuple[Impl, list, list]:
    """The compiled impl for one bound step, and the arguments to bind it with.

    Arena values are dtype views of one uint8 buffer: they share one storage through
    different ``_base`` tensors, which AOTAutograd cannot mutate ("synthetic bases"). So
    each tensor is re-bound as a non-owning alias with a storage object of its own (the
    executor's arena outlives the step). That is exact whenever no output overlaps an
    input: the planner guarantees it except where an op declares an output in place and
    the plan took it; those steps run the pure form (fresh outputs, then one copy each).
    """
    tensors_in = [t for t in inputs if isinstance(t, torch.Tensor)]  # others: run-time inputs
    if _any_overlap(tensors_in, [t for t in outputs if isinstance(t, torch.Tensor)]):
        return compiled_impl(op), inputs, outputs
    if op.name not in _compiled_in_place:
        _raise_recompile_limit()
        _compiled_in_place[op.name] = torch.compile(op.impl, dynamic=False, options=INDUCTOR_OPTIONS)
    def rebind(ts):
        return [storage_alias(t) if isinstance(t, torch.Tensor) else t for t in ts]

    return _compiled_in_place[op.name], rebind(inputs), rebind(outputs)


def storage_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a tensor with its own (non-owning) storage object."""
    nbytes = _span_bytes(t)
    storage = torch._C._construct_storage_from_data_pointer(t.data_ptr(), t.device, nbytes)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def _span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _any_overlap(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    def span(t):
        return t.data_ptr(), t.data_ptr() + _span_bytes(t)

    return any(a0 < b1 and b0 < a1 for a0, a1 in map(span, outputs) for b0, b1 in map(span, inputs))


def _raise_recompile_limit() -> None:
    # Each (op, batch bucket, attrs) is one specialisation; a proposer has up to 7 buckets
    # and a few attr sets per op, more than dynamo's default of 8 recompiles.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def compiled_impl(op: OpDef) -> Impl:
    """``op.impl`` through torch.compile as a pure function: fresh outputs, copied into the views.

    For steps whose outputs overlap an input (in-place ops the plan aliased): inductor
    may write such an output before a later kernel of the same op reads the input.
    """
    if op.name not in _compiled:
        _raise_recompile_limit()
        pure = torch.compile(_returning(op.impl), dynamic=False, options=INDUCTOR_OPTIONS)

        def impl(inputs, outputs, attrs, workspace, pure=pure):
            results = pure(inputs, tuple((o.shape, o.dtype) for o in outputs), attrs)
            for out, result in zip(outputs, results):
                out.copy_(result)

        _compiled[op.name] = impl
    return _compiled[op.name]


def _returning(impl: Impl):
    def run(inputs, out_specs, attrs):
        device = inputs[0].device
        outputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in out_specs]
        impl(inputs, outputs, attrs, None)
        return outputs

    return run
