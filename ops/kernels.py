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

import torch

from ops.registry import Impl, OpDef
from runtime.errors import InputError, describe

KERNELS = ("auto", "torch", "compiled")
# Ops whose torch implementation is already one library call (or a view): nothing to fuse.
NOT_COMPILED = frozenset({"add", "body_runner", "embed", "linear", "minimum", "mul", "offset_positions", "reshape"})
_compiled: dict[str, Impl] = {}


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise InputError(describe("kernels", " or ".join(repr(k) for k in KERNELS), repr(kernels)))
    return kernels


def select_impl(op: OpDef, device: torch.device, kernels: str) -> Impl:
    if kernels == "auto":
        return op.select_impl(device, use_fused=True)
    if kernels == "compiled" and op.name not in NOT_COMPILED:
        return compiled_impl(op)
    return op.impl


def compiled_impl(op: OpDef) -> Impl:
    """``op.impl`` through torch.compile; one compiled function per op, shared by every executor.

    The compiled function is pure: it returns fresh outputs, copied into the planned views
    after it ran. Arena values are dtype views of one uint8 buffer, so they share storage
    with different ``_base`` tensors; AOTAutograd cannot mutate such an input, and an
    output declared in place may alias an input that inductor would read after writing.
    The copies cost one small kernel per output; only state (the KV cache, its own
    storage) is mutated inside.
    """
    if op.name not in _compiled:
        # Each (op, batch bucket, attrs) is one specialisation; a proposer has up to 7 buckets
        # and a few attr sets per op, more than dynamo's default of 8 recompiles.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        pure = torch.compile(_returning(op.impl), dynamic=False)

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
