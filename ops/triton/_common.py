"""Shared pieces of the Triton kernels: the interpreter switch, scratch carving, tiny helpers.

Only imported when triton is importable (``register_all`` checks first).

Note "interpreter dot": Triton's CPU interpreter (``TRITON_INTERPRET=1``) multiplies
bf16 operands of ``tl.dot`` as their raw uint16 bits (triton 3.9), so every kernel takes
an ``INTERP`` constexpr and upcasts dot operands to fp32 under the interpreter. On the
GPU the operands stay bf16 (fp32 accumulate), which is the fast path being tested.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SCRATCH_ALIGN = 256  # bytes: every carved scratch buffer starts on this boundary


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter_rounding() -> None:
    """Make the CPU interpreter round fp32 -> bf16 to nearest even, as the GPU does.

    Triton's interpreter (3.9) truncates that cast, which makes every bf16 output differ
    from torch's by up to an ulp; the tests and the bench's dry run patch it.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_draftgraph_rtne", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._draftgraph_rtne = True


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def batch_block(batch: int) -> int:
    """Rows of activations per dot tile: tl.dot needs every dim >= 16."""
    return max(16, min(64, next_pow2(batch)))


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // SCRATCH_ALIGN) * SCRATCH_ALIGN


def scratch_bytes(parts: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the scratch that :func:`carve` cuts into ``parts`` (shape, dtype)."""
    return sum(_aligned(_numel(shape) * dtype.itemsize) for shape, dtype in parts)


def carve(workspace: torch.Tensor | None, device: torch.device, parts) -> list[torch.Tensor]:
    """Cut typed scratch tensors out of ``workspace`` (uint8), or allocate when it is too small.

    Allocating inside an op is what the torch reference ops do too (their temporaries);
    under CUDA-graph capture it draws from the capture's pool. Declaring the bytes as the
    op's workspace (see ``workspace_rule`` in each module) makes it planned arena memory.
    """
    total = scratch_bytes(parts)
    if workspace is None or workspace.numel() < total:
        workspace = torch.empty(total, dtype=torch.uint8, device=device)
    out, offset = [], 0
    for shape, dtype in parts:
        nbytes = _numel(shape) * dtype.itemsize
        out.append(workspace[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@triton.jit
def mma(a, b, INTERP: tl.constexpr):
    """a @ b with fp32 accumulation; see "interpreter dot" in the module docstring."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def log1p_exp_neg(a):
    """log(1 + exp(-a)) for a >= 0, accurate when exp(-a) is tiny (no libdevice log1p)."""
    t = tl.exp(-a)
    u = 1.0 + t
    # log(u) * t / (u - 1) corrects the rounding of 1 + t (Goldberg's log1p trick).
    return tl.where(u == 1.0, t, tl.log(u) * t / (u - 1.0))


@triton.jit
def softplus(z):
    """torch.nn.functional.softplus (beta 1, threshold 20), computed without overflow."""
    stable = tl.maximum(z, 0.0) + log1p_exp_neg(tl.abs(z))
    return tl.where(z > 20.0, z, stable)
