"""MXFP4 routed experts (e2m1 pairs, 1 x 32 UE8M0 scales), decoded in registers.

So far the e2m1 decoder only; the MoE kernels that use it come next.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_to_f32(c):
    """e2m1 codes (int32 0..15, bit 3 the sign) -> fp32: 0 .5 1 1.5 2 3 4 6, exactly, from the bits."""
    mag = c & 7
    e = (mag >> 1).to(tl.uint32)
    m = (mag & 1).to(tl.uint32)
    # e > 0: 2^(e-1) * (1 + m/2), fp32 exponent field e + 126; e == 0: m * 0.5 (exponent field 126).
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((c & 8).to(tl.uint32) << 28)
    return bits.to(tl.float32, bitcast=True)
