"""lm_head (final norm + head GEMV, fp32 logits) and draft_argmax (two-stage masked argmax + prob).

lm_head: the [B, D] input is normed by a one-program-per-row kernel into scratch (bf16,
as the reference rounds it), then the GEMV streams the [vocab_rows, D] head once.
``LM_HEAD_PROLOGUE`` instead norms inside every GEMV program (one launch fewer, an
extra L2 pass over x per program): the bench times both.

An FP8 head (``ProposerOptions.head_dtype="fp8"``: a QuantWeight, e4m3 with 128 x 128 UE8M0
scales) streams through ``fp8_linear.fp8_gemv`` instead, on the stored bytes (half the bf16
head's): the same norm (scratch, or the prologue under ``LM_HEAD_PROLOGUE``), fp32 logits.
``lm_head_impl.unsupported_block_scaled`` tells kernel_choice it reads FP8 heads only.

draft_argmax: stage 1 gives each (row, vocab chunk) its masked max, the lowest id that
reaches it and sum exp(l - max) over allowed ids; stage 2 merges the chunks per row with
the usual rescaling (sum_c s_c * exp(m_c - M)), so the top-1 probability comes out of the
same pass as the argmax. A row with nothing allowed gets token 0 and prob 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.triton import gemv as gemv_mod
from draftgraph.ops.triton._common import carve, next_pow2, pdl_args, pdl_wait, scratch_bytes
from draftgraph.runtime.model.quant import QuantWeight

LM_HEAD_PROLOGUE = False
# The head past 16 rows (gemv's dot path: the FMA LM_HEAD_CONFIG holds one row, and up to 16 rows
# take gemv.BATCHED). At B=32 the head on BATCHED's 64 x 128 tiles ran at 88% of DRAM peak where
# B=1's FMA tiles reach 95% (ncu_chain_b1_b32_h100.txt); 128 x 128 tiles on 8 warps with 3 stages
# took the chain at B=32 -7.7 / -8.5 / -8.8 us in three calls on an H100, and B=8 +4.0 / +1.4 (noise),
# so only past 16 rows (benchmarks/h200/head_tiles_f16_dot_h100_log.txt, scale_ahead_head_2e3538d_h100_log.txt).
LM_HEAD_LARGE_BATCH_CONFIG = gemv_mod.GemvConfig(block_n=128, block_k=128, num_warps=8, num_stages=3)
ARGMAX_BLOCK_V = 4096  # vocab ids per stage-1 program: 32 programs a row at V4-Flash


def head_config(rows: int) -> gemv_mod.GemvConfig:
    """The bf16 head GEMV's tiles at ``rows`` activation rows (read at call time: sweeps set the knobs)."""
    if rows == 1:
        return gemv_mod.LM_HEAD_CONFIG
    return gemv_mod.BATCHED if rows <= 16 else LM_HEAD_LARGE_BATCH_CONFIG


def plan(inputs, outputs, attrs, workspace) -> list[tuple[str, callable]]:
    """The launches of one lm_head call, as (name, thunk)."""
    h, norm_w, head = inputs
    (logits,) = outputs  # [B, Vd] fp32
    eps = float(attrs["eps"])
    if isinstance(head, QuantWeight):
        gemv = _fp8_head_gemv(head, logits)
    else:
        w = head[: logits.shape[1]]

        def gemv(x, **norm):
            gemv_mod.gemv(x, w, logits, config=head_config(x.shape[0]), **norm)

    if LM_HEAD_PROLOGUE:
        return [("norm+gemv", lambda: gemv(h, norm_w=norm_w, eps=eps))]
    (normed,) = carve(workspace, h.device, [(tuple(h.shape), h.dtype)])
    return [
        ("norm", lambda: gemv_mod.rms_norm_rows(h, norm_w, eps, normed)),
        ("gemv", lambda: gemv(normed)),
    ]


def _fp8_head_gemv(head: QuantWeight, logits: torch.Tensor):
    """The GEMV over the first vocab_rows rows of an FP8 head: its bytes and the scale rows covering them."""
    from draftgraph.ops.triton import fp8_linear

    rows = logits.shape[1]
    data = head.data[:rows]  # [Vd, D]
    scale = head.scale[: -(-rows // 128)]  # the 128-row scale blocks covering them (the last may be partial)
    cfg = fp8_linear.config_for(logits.shape[0], rows)  # its outputs too: the wide-grid rule counts its tiles

    def gemv(x, **norm):
        fp8_linear.fp8_gemv(x, data, scale, logits, config=cfg, **norm)

    return gemv


def lm_head_impl(inputs, outputs, attrs, workspace):
    h, norm_w, head = inputs
    (logits,) = outputs
    if h.dtype not in (torch.bfloat16, torch.float16) or logits.stride(1) != 1 or not _readable_head(head):
        from draftgraph.ops.lm_head import _lm_head_impl

        return _lm_head_impl(inputs, outputs, attrs, workspace)
    for _, launch in plan(inputs, outputs, attrs, workspace):
        launch()


def _readable_head(head) -> bool:
    if isinstance(head, QuantWeight):
        return head.fmt == "fp8" and head.data.is_contiguous() and head.scale.is_contiguous()
    return head.stride(1) == 1


def _head_block_scaled(specs) -> str | None:
    head = specs[2]
    return None if head.quant == "fp8" else f"no {head.quant} GEMV kernel for the head (FP8 only)"


lm_head_impl.unsupported_block_scaled = _head_block_scaled


def lm_head_workspace(specs, attrs, batch: int) -> int:
    h = specs[0]
    return scratch_bytes([((batch, h.shape[1]), h.dtype)])


# ---- draft_argmax ----------------------------------------------------------------------------


@triton.jit
def _argmax_partial_kernel(
    logits_ptr,
    limit_ptr,
    mask_ptr,
    pmax_ptr,
    pidx_ptr,
    psum_ptr,
    V,
    stride_l,
    stride_m,
    NUM_CHUNKS,
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK_V + tl.arange(0, BLOCK_V)
    limit = tl.minimum(tl.load(limit_ptr), V)
    allowed = offs < limit
    if HAS_MASK:
        word = tl.load(mask_ptr + b.to(tl.int64) * stride_m + offs // 32, mask=allowed, other=0)
        allowed = allowed & (((word >> (offs % 32)) & 1) != 0)
    lv = tl.load(logits_ptr + b.to(tl.int64) * stride_l + offs, mask=allowed, other=float("-inf"))
    lv = tl.where(allowed, lv, float("-inf"))
    m = tl.max(lv, 0)
    idx = tl.min(tl.where(allowed & (lv == m), offs, 2147483647), 0)
    s = tl.sum(tl.where(allowed, tl.exp(lv - m), 0.0), 0)
    out = b * NUM_CHUNKS + c
    tl.store(pmax_ptr + out, m)
    tl.store(pidx_ptr + out, idx)
    tl.store(psum_ptr + out, s)


@triton.jit
def _argmax_final_kernel(
    pmax_ptr, pidx_ptr, psum_ptr, token_ptr, prob_ptr, NUM_CHUNKS, BLOCK_C: tl.constexpr, PDL: tl.constexpr
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    cm = offs < NUM_CHUNKS
    m = tl.load(pmax_ptr + b * NUM_CHUNKS + offs, mask=cm, other=float("-inf"))
    i = tl.load(pidx_ptr + b * NUM_CHUNKS + offs, mask=cm, other=2147483647)
    s = tl.load(psum_ptr + b * NUM_CHUNKS + offs, mask=cm, other=0.0)
    best = tl.max(m, 0)
    live = m > float("-inf")
    any_allowed = best > float("-inf")
    token = tl.min(tl.where(live & (m == best), i, 2147483647), 0)
    denom = tl.sum(tl.where(live, s * tl.exp(m - best), 0.0), 0)
    prob = tl.where(any_allowed, 1.0 / tl.maximum(denom, 1.0), 0.0)
    tl.store(token_ptr + b, tl.where(any_allowed, token, 0).to(tl.int64))
    tl.store(prob_ptr + b, prob)


def _argmax_chunks(vocab: int) -> tuple[int, int]:
    block = min(ARGMAX_BLOCK_V, next_pow2(vocab))
    return block, triton.cdiv(vocab, block)


def draft_argmax_impl(inputs, outputs, attrs, workspace):
    logits, limit = inputs[0], inputs[1]
    mask = inputs[2] if len(inputs) > 2 else None
    token, prob = outputs
    b, vocab = logits.shape
    if logits.stride(1) != 1 or (mask is not None and mask.stride(1) != 1):
        from draftgraph.ops.sampling import _draft_argmax_impl

        return _draft_argmax_impl(inputs, outputs, attrs, workspace)
    block, chunks = _argmax_chunks(vocab)
    pmax, pidx, psum = carve(workspace, logits.device, _argmax_parts(b, chunks))
    _argmax_partial_kernel[(b, chunks)](
        logits,
        limit,
        mask if mask is not None else limit,
        pmax,
        pidx,
        psum,
        vocab,
        logits.stride(0),
        mask.stride(0) if mask is not None else 0,
        chunks,
        BLOCK_V=block,
        HAS_MASK=mask is not None,
        num_warps=8 if block >= 2048 else 4,
        **pdl_args(logits.device),
    )
    _argmax_final_kernel[(b,)](
        pmax, pidx, psum, token, prob, chunks, BLOCK_C=next_pow2(chunks), num_warps=1, **pdl_args(logits.device)
    )


def _argmax_parts(b: int, chunks: int):
    return [((b, chunks), torch.float32), ((b, chunks), torch.int32), ((b, chunks), torch.float32)]


def draft_argmax_workspace(specs, attrs, batch: int) -> int:
    _, chunks = _argmax_chunks(specs[0].shape[1])
    return scratch_bytes(_argmax_parts(batch, chunks))
