"""gather_rows: copy rows from device addresses read on the device into one static buffer.

Why: a propose's target hiddens live wherever the target left them, a new address every
time, so a captured graph cannot hold a memcpy node for them, and a copy queued by the
host before each replay costs a CUDA call (5-10 us of host time on the H200 hosts; at B=32
a stack of 32 tensors costs more). Instead the host writes each row's address into the
pinned staging buffer (8 bytes, no CUDA call), the graph's staging copy brings them over
with everything else, and this kernel, captured right after it, reads the addresses and
copies the rows. Address 0 is a padded row: zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.triton._common import splat

BLOCK = 2048  # elements per program: a V4 streams row (4 x 4096 bf16) is 8 programs


@triton.jit
def _gather_rows_kernel(addresses, out, row_elems, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    address = tl.load(addresses + row)
    source = address.to(tl.pointer_type(out.dtype.element_ty), bitcast=True)
    inside = offsets < row_elems
    values = tl.load(source + offsets, mask=inside & splat(address != 0, offsets), other=0)
    tl.store(out + row * row_elems + offsets, values, mask=inside)


def gather_rows(addresses: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b] = the row of out.shape[1:] at device address addresses[b]`` (zeros where 0).

    ``addresses`` is int64 [B] on ``out``'s device; ``out`` is contiguous [B, ...]. Every
    nonzero address must point at a live, contiguous row of ``out``'s dtype on that device.
    """
    rows = out.shape[0]
    row_elems = out[0].numel() if rows else 0
    if rows == 0 or row_elems == 0:
        return
    grid = (rows, triton.cdiv(row_elems, BLOCK))
    _gather_rows_kernel[grid](addresses, out, row_elems, BLOCK=BLOCK)


__all__ = ["gather_rows"]
