"""stage_from_host and copy_to_host: a captured chain's first kernel (the staging copy and the
hidden gather) and its last (the drafts written to pinned host memory).

Why the gather: a propose's target hiddens live wherever the target left them, a new address
every time, so a captured graph cannot hold a memcpy node for them, and a copy queued by the
host before each replay costs a CUDA call (5-10 us of host time on the H200 hosts; at B=32
a stack of 32 tensors costs more). Instead the host writes each row's address into the
pinned staging buffer (8 bytes, no CUDA call) and this kernel reads the addresses and copies
the rows. Address 0 is a padded row: zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.triton._common import splat

BLOCK = 2048  # elements per program: a V4 streams row (4 x 4096 bf16) is 8 programs


@triton.jit
def _stage_kernel(host, staged, staged_words, address_at, out, row_elems, copy_programs,
                  WORDS: tl.constexpr, BLOCK: tl.constexpr):
    # Programs [0, copy_programs) copy the host buffer's words; the rest gather the hidden rows,
    # each reading its row's address from the host buffer itself (not from the copy, which
    # another program may not have written yet).
    program = tl.program_id(0)
    if program < copy_programs:
        words = program * WORDS + tl.arange(0, WORDS)
        in_buffer = words < staged_words
        source = host.to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(staged + words, tl.load(source + words, mask=in_buffer), mask=in_buffer)
    else:
        per_row = tl.cdiv(row_elems, BLOCK)
        row = (program - copy_programs) // per_row
        elems = (program - copy_programs) % per_row * BLOCK + tl.arange(0, BLOCK)
        address = tl.load((host + address_at + 8 * row).to(tl.pointer_type(tl.int64), bitcast=True))
        row_source = address.to(tl.pointer_type(out.dtype.element_ty), bitcast=True)
        in_row = elems < row_elems
        values = tl.load(row_source + elems, mask=in_row & splat(address != 0, elems), other=0)
        tl.store(out + row * row_elems + elems, values, mask=in_row)


STAGE_WORDS = 1024  # int32 words per copying program: 4 KB


def stage_from_host(host: torch.Tensor, staged: torch.Tensor, address_at: int, out: torch.Tensor) -> None:
    """``staged[:] = host[:staged.nbytes]``, and each row of ``out`` from its address, in one kernel.

    Why: captured, the staging copy was a memcpy node, and on an H200 the first kernel after
    it started ~10 us after the copy ended (a copy-engine node's hand-off to the SMs). A
    kernel reads the pinned host buffer itself (pinned memory is mapped into the device's
    address space under unified addressing: the host pointer is the device pointer), so the
    copy and the gather are one kernel node and the chain's next kernel follows it at once.
    ``host`` is pinned (or, under the interpreter, any CPU tensor), ``staged`` contiguous with
    a byte count that is a multiple of 4, ``out`` contiguous [B, ...]; the address of row b
    is the int64 at ``host`` byte ``address_at + 8 b`` (0: zeros).
    """
    words = staged.nbytes // 4
    copy_programs = triton.cdiv(words, STAGE_WORDS)
    rows = out.shape[0]
    row_elems = out[0].numel() if rows else 0
    gather_programs = rows * triton.cdiv(row_elems, BLOCK) if row_elems else 0
    grid = (copy_programs + gather_programs,)
    _stage_kernel[grid](host.data_ptr(), staged.view(torch.int32), words, address_at, out, max(row_elems, 1),
                        copy_programs, WORDS=STAGE_WORDS, BLOCK=BLOCK)


@triton.jit
def _copy_to_host_kernel(src, host, words, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    dst = host.to(tl.pointer_type(tl.int32), bitcast=True)
    for start in range(0, words, BLOCK):
        inside = start + offs < words
        tl.store(dst + start + offs, tl.load(src + start + offs, mask=inside), mask=inside)


COPY_WORDS = 1024  # int32 words a loop step of the one program: a chain's drafts are at most 64 x 8 int64


def copy_to_host(src: torch.Tensor, host: torch.Tensor) -> None:
    """``host[:] = src`` by one program's stores into pinned memory (mapped: the host pointer is the
    device pointer, as ``stage_from_host`` reads it).

    Why: the read-back of a chain's drafts was a copy queued after the replay, and a copy-engine
    transfer starts microseconds after the kernel before it ends (the hand-off ``stage_from_host``
    removed at the head of the graph). Captured as the chain's last node, this kernel leaves the
    drafts in host memory when the replay ends: a propose waits for the stream and reads them.
    ``src`` contiguous, device; ``host`` pinned (under the interpreter, any CPU tensor), the same
    byte count, a multiple of 4.
    """
    words = src.nbytes // 4
    _copy_to_host_kernel[(1,)](src.view(-1).view(torch.int32), host.data_ptr(), words, BLOCK=COPY_WORDS,
                               num_warps=4)  # fmt: skip


__all__ = ["copy_to_host", "stage_from_host"]
