"""Shared pieces of the Triton kernels: the interpreter switch, scratch carving, tiny helpers.

Only imported when triton is importable (``register_all`` checks first).

Note "interpreter dot": Triton's CPU interpreter (``TRITON_INTERPRET=1``) multiplies
bf16 operands of ``tl.dot`` as their raw uint16 bits (triton 3.9), so every kernel takes
an ``INTERP`` constexpr and upcasts dot operands to fp32 under the interpreter. On the
GPU the operands stay bf16 (fp32 accumulate), which is the fast path being tested.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

SCRATCH_ALIGN = 256  # bytes: every carved scratch buffer starts on this boundary


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- programmatic dependent launch (PDL) ------------------------------------------------------
#
# On sm90+ every kernel here is launched with PDL and starts with ``pdl_wait``: it may be
# scheduled while the previous kernel drains (that kernel let it, by calling
# launch_dependents once all its programs had started), and waits for the previous kernel
# to finish before it reads or writes anything the step computes. Weights are never
# written during a step, so a GEMV loads its first weight tile before the wait: in a
# captured graph that load overlaps the tail of the kernel before (e.g. the latency-bound
# Sinkhorn finish), which is where the launch gaps of a 30-launch step go.
# ``DRAFTGRAPH_PDL=0`` or ``set_pdl(False)`` turns it off (the bench compares both).

_pdl_override: bool | None = None


def set_pdl(enabled: bool | None) -> None:
    """Force PDL on or off for launches from now on (``None``: the default, by capability)."""
    global _pdl_override
    _pdl_override = enabled


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except Exception:  # not the NVIDIA backend, or a triton without it
        return False
    has_api = hasattr(tl_cuda, "gdc_wait") and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
    return has_api and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _pdl_supported(index):
        return False
    if _pdl_override is not None:
        return _pdl_override
    return os.environ.get("DRAFTGRAPH_PDL", "1") != "0"


def pdl_args(device: torch.device) -> dict:
    """The PDL constexpr and launch option of one kernel launch on ``device``."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (PDL launches), then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def splat(flag, like):
    """A scalar bool as a bool tensor shaped like ``like`` (the interpreter rejects the implicit one)."""
    return (like * 0 + flag.to(tl.int32)) != 0


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


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """t as [R, last] without a copy (unit last stride, one stride between rows), or None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def rows_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data and each of its rows (every stride but the last) start on 16
    bytes: the host's half of ``tile_pointers``' ALIGNED hint."""
    return all(t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
               for t in tensors)  # fmt: skip


@triton.jit
def tile_pointers(rows, cols, ALIGNED: tl.constexpr):
    """A tile's pointers, rows [R, 1] x columns cols [C]; with ALIGNED hinted as rows that start on
    16 bytes with contiguous columns (fp8_linear's and moe_grouped's note "aligned rows": where a
    matrix is picked at run time, Triton loses that and loads an element at a time). The host
    checks it. The sum is made here: a hint attaches to the op that defines its value, and a value
    passed in as an argument has none here (hinted, it read element by element again)."""
    ptrs = rows + cols[None, :]
    if ALIGNED:
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16]), [1, 16])
    return ptrs


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


@triton.jit
def clamped_swiglu(gate, up, limit):
    """silu(min(gate, limit)) * clamp(up, -limit, limit): the V4 expert activation (fp32)."""
    g = tl.minimum(gate, limit)
    return g / (1.0 + tl.exp(-g)) * tl.minimum(tl.maximum(up, -limit), limit)


@triton.jit
def zero_share(counts, n, program, SHARE: tl.constexpr):
    """Zero program ``program``'s share (SHARE consecutive entries) of ``n`` arrival counts: the
    launch before a split one, a program each share, so the counts start at 0 (``last_to_arrive``)."""
    c = program * SHARE + tl.arange(0, SHARE)
    tl.store(counts + c, tl.zeros([SHARE], dtype=tl.int32), mask=c < n)


@triton.jit
def last_to_arrive(counter, SPLIT: tl.constexpr):
    """Whether this program is the last of the SPLIT programs sharing ``counter`` to finish its part
    (split-K MoE, split-window attention): every thread's partials are stored before the count
    moves (the barrier, then a release), and the last one's loads of the others' come after it saw
    them (acquire). Read the others' partials with ``volatile=True`` (never a stale L1 line). The
    count is back at 0 after the launch."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = ticket == SPLIT - 1
    # Every part has counted: the last one resets the count for a launch that repeats without the
    # op's zeroing launch before it (a phase timed alone). The zeroing stays: the count lives in
    # scratch that other ops overwrite between launches.
    tl.atomic_xchg(counter, 0, mask=last, sem="relaxed", scope="gpu")
    return last
