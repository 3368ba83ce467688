"""The combiner: out = h_proj(hnorm(h)) + e_proj(enorm(e)), e's row broadcast over h's C streams.

bf16 weights, five launches (as the fused path ran the op's five nodes): a row norm and a GEMV
per half, then the sum. Not the normed GEMV (``norm_w``): its prologue re-reads the row in each of
the 512 programs, and it measured 29 us slower at B=1 on an H200 (0.513 against 0.484 ms a step).

Note "two launches": with FP8 e_proj and h_proj (native weights),
1. norms, grid (B + R,): program r < B norms e's row r, the others h's R rows (B x C streams, or
   B collapsed), into scratch; the same programs zero the GEMV's arrival counts.
2. ``fp8_gemv``'s "two Ks": out[r] = hn[r] @ h_proj^T + en[r // C] @ e_proj^T in one launch, K
   cut into ``COMBINER_SPLIT`` parts a tile (half of them on each matrix), summed in part order by
   the tile's last part to finish: fp32, one rounding.
The five launches this replaces (two norms, a GEMV a half, torch's add) took 42 us of an H100's
B=1 step alone for 33.6 MB (11 us of bandwidth), the e_proj GEMV on 1 row and h_proj's on the 4
stream rows each too few programs to fill the memory system. Up to ``COMBINER_MAX_ROWS`` h rows:
the partials are 4 bytes a row and column a part, 8 MB at B=32's 128 stream rows. Past it, and
with one FP8 projection and one bf16, the norms, a GEMV a half and the sum remain. W8A8
(``activations="fp8"``): the norms write each FP8 half's input rounded through FP8 (``norm_row``'s
ROUND_FP8, fp8_round's arithmetic), so the rounding costs no launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.quantised import is_quantised, w8a8_rounds
from draftgraph.ops.triton._common import carve, next_pow2, pdl_args, pdl_wait, rows_view, scratch_bytes, zero_share
from draftgraph.ops.triton.gemv import (
    _HALF,
    LINEAR_CONFIG,
    _dense,
    _fp8,
    gemv,
    norm_block,
    norm_row,
    rms_norm_rows,
)

COMBINER_SPLIT = 4  # parts of the two Ks of the FP8 combiner's GEMV ("two launches"); even (odd: five launches)
# Up to this many h rows (B x C streams): past it the split's fp32 partials cost more than the
# launches saved (H100, the chain: B=1's 4 rows 0.546 -> 0.534 ms, B=8's 32 0.672 -> 0.675, B=32's
# 128 0.914 -> 0.953; benchmarks/h200/README.md, "thirteenth session"). Again at 27f1d21 (H100, one
# process each): past it with split 4 B=8 +7 us, B=32 +18; with split 2 +5 / +8, for three nodes fewer
# (benchmarks/h200/combiner_two_launch_rows_27f1d21_h100_log.txt).
COMBINER_MAX_ROWS = 16


@triton.jit
def _two_norms_kernel(
    e_ptr,
    e_idx_ptr,
    h_ptr,
    ew_ptr,
    hw_ptr,
    en_ptr,
    hn_ptr,
    cnt_ptr,
    B,
    D,
    n_cnt,
    stride_e,
    stride_h,
    stride_en,
    stride_hn,
    eps,
    BLOCK_D: tl.constexpr,
    CNT_BLOCK: tl.constexpr,
    ROUND_FP8: tl.constexpr,
    E_GATHER: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    r = tl.program_id(0)
    if CNT_BLOCK > 0:  # this program's share of the GEMV's arrival counts
        zero_share(cnt_ptr, n_cnt, r, CNT_BLOCK)
    if r < B:
        e_row = tl.load(e_idx_ptr + r).to(tl.int64) if E_GATHER else r.to(tl.int64)  # note "rows from the table"
        src = e_ptr + e_row * stride_e
        w_ptr = ew_ptr
        dst = en_ptr + r.to(tl.int64) * stride_en
    else:
        src = h_ptr + (r - B).to(tl.int64) * stride_h
        w_ptr = hw_ptr
        dst = hn_ptr + (r - B).to(tl.int64) * stride_hn
    norm_row(src, w_ptr, dst, D, eps, BLOCK_D, ROUND_FP8)


def _fp8_parts(b: int, rows: int, d: int, n: int, dtype: torch.dtype):
    """Scratch of the two-launch FP8 path: en, hn, the split's partials, the arrival counts."""
    fp8 = _fp8()
    tiles = fp8.split_tiles(rows, n, n, 2 * d, fp8.config_for(rows), split_k=COMBINER_SPLIT)
    return [((b, d), dtype), ((rows, d), dtype), ((COMBINER_SPLIT * rows * n,), torch.float32), ((tiles,), torch.int32)]


def combiner_workspace(specs, attrs, batch: int) -> int:
    """Scratch bytes of the fused combiner at a concrete batch (the FP8 path's; the others allocate)."""
    e, h, e_proj, h_proj = specs[0], specs[1], specs[4], specs[5]
    rows = batch * (h.shape[1] if len(h.shape) == 3 else 1)
    if e_proj.quant != "fp8" or h_proj.quant != "fp8" or rows > COMBINER_MAX_ROWS:
        return 0
    return scratch_bytes(_fp8_parts(batch, rows, e.shape[-1], h_proj.shape[0], e.dtype))


def embed_combiner_workspace(specs, attrs, batch: int) -> int:
    """combiner_workspace of the folded op: the table [V, D] in e's place gives D and the dtype."""
    return combiner_workspace(specs[1:], attrs, batch)


def combiner_impl(inputs, outputs, attrs, workspace):
    """The fused combiner (see the module docstring); the torch op where the kernels do not apply."""
    from draftgraph.ops.combiner import _combiner_impl

    if not _combine(inputs[0], None, *inputs[1:], outputs[0], attrs, workspace):
        _combiner_impl(inputs, outputs, attrs, workspace)


def embed_combiner_impl(inputs, outputs, attrs, workspace):
    """The fused combiner whose e rows are the embedding table's rows at the tokens (note "rows from the table")."""
    from draftgraph.ops.combiner import _embed_combiner_impl

    token, table, *rest = inputs
    gathers = token.dtype == torch.int64 and token.dim() == 1
    if not (gathers and _combine(table, token, *rest, outputs[0], attrs, workspace)):
        _embed_combiner_impl(inputs, outputs, attrs, workspace)


def _combine(e, e_index, h, e_norm, h_norm, e_proj, h_proj, out, attrs, workspace) -> bool:
    """The kernels' combiner, e's rows ``e[e_index]`` where an index is given (else e's rows);
    False (nothing run) for inputs they do not cover."""
    h2 = rows_view(h)
    if (e.dtype not in _HALF or e.dim() != 2 or h2 is None or e.stride(-1) != 1 or e.shape[-1] > 16384
            or any(w.dtype != e.dtype or not w.is_contiguous() for w in (e_norm, h_norm))
            or not all(_readable(w, e.dtype) for w in (e_proj, h_proj))):  # fmt: skip
        return False
    eps = float(attrs["eps"])
    rows = NormRows(e, e_index)
    out2 = rows_view(out)
    two = is_quantised(e_proj) and is_quantised(h_proj) and out2 is not None and COMBINER_SPLIT % 2 == 0
    if two and h2.shape[0] <= COMBINER_MAX_ROWS:
        _combine_two_launches(rows, h2, e_norm, h_norm, e_proj, h_proj, out2, eps, attrs, workspace)
    elif is_quantised(e_proj) or is_quantised(h_proj):
        _combine_fp8(rows, h, h2, e_norm, h_norm, e_proj, h_proj, out, eps, attrs)
    else:
        parts = []
        for x, norm_w, proj_w in ((rows, e_norm, e_proj), (NormRows(h2, None), h_norm, h_proj)):
            normed = x.empty()
            x.norm_into(norm_w, eps, normed)
            parts.append(x.empty())
            gemv(normed, proj_w, parts[-1], config=LINEAR_CONFIG)
        e_part, h_part = parts
        torch.add(h_part.view(h.shape), e_part.unsqueeze(1) if h.dim() == 3 else e_part, out=out)
    return True


class NormRows:
    """The rows a combiner's norm reads: ``source``'s rows, or with ``index`` its rows at the index
    (e's rows as the embedding table's rows at the tokens: note "rows from the table")."""

    __slots__ = ("source", "index", "batch")

    def __init__(self, source: torch.Tensor, index: torch.Tensor | None):
        self.source, self.index = source, index
        self.batch = source.shape[0] if index is None else index.shape[0]

    def empty(self) -> torch.Tensor:
        """A new [batch, D] tensor of the rows' dtype."""
        return torch.empty((self.batch, self.source.shape[1]), dtype=self.source.dtype, device=self.source.device)

    def norm_into(self, weight: torch.Tensor, eps: float, out: torch.Tensor, round_fp8: bool = False) -> None:
        rms_norm_rows(self.source, weight, eps, out, round_fp8=round_fp8, index=self.index)


def _combine_two_launches(e: NormRows, h2, e_norm, h_norm, e_proj, h_proj, out2, eps, attrs, workspace) -> None:
    """FP8 e_proj and h_proj: the norms, then one GEMV over both Ks (note "two launches")."""
    b, d = e.batch, e.source.shape[1]
    rows, n = h2.shape[0], h_proj.logical_shape[0]
    en, hn, partials, arrivals = carve(workspace, e.source.device, _fp8_parts(b, rows, d, n, e.source.dtype))
    share = triton.cdiv(arrivals.numel(), b + rows)
    w8a8 = w8a8_rounds(h_proj, attrs)  # both halves FP8 here: the norms write them rounded
    gather = e.index is not None
    _two_norms_kernel[(b + rows,)](
        e.source, e.index if gather else e.source, h2, e_norm, h_norm, en, hn, arrivals,
        b, d, arrivals.numel(), e.source.stride(0), h2.stride(0), en.stride(0), hn.stride(0), eps,
        BLOCK_D=norm_block(d, w8a8), CNT_BLOCK=next_pow2(share), ROUND_FP8=w8a8, E_GATHER=gather,
        num_warps=4 if d <= 4096 else 8, **pdl_args(e.source.device),
    )  # fmt: skip
    fp8 = _fp8()
    fp8.fp8_gemv(
        hn, h_proj.data, h_proj.scale, out2,
        w2=e_proj.data, w2_scale=e_proj.scale, x2=en, x2_row_div=rows // b,
        split_k=COMBINER_SPLIT, split_reduce=(partials, arrivals), config=fp8.config_for(rows),
    )  # fmt: skip


def _combine_fp8(e: NormRows, h, h2, e_norm, h_norm, e_proj, h_proj, out, eps, attrs) -> None:
    """One FP8 projection and one bf16 (or an output that is no rows view): norm, W8A8 rounding, GEMV.

    Collapsed (h [B, D]) with an FP8 e_proj, the e half accumulates onto the h half in ``out``
    (fp32 add, one rounding: no e_part buffer, no add launch); in streams mode e_proj(enorm(e))
    is one [B, D] part added to every stream, as the torch op does.
    """
    project = _fp8().project
    e_in, h_in = e.empty(), torch.empty_like(h2)
    e.norm_into(e_norm, eps, e_in, round_fp8=w8a8_rounds(e_proj, attrs))  # W8A8: rounded by the norm
    rms_norm_rows(h2, h_norm, eps, h_in, round_fp8=w8a8_rounds(h_proj, attrs))
    out2 = rows_view(out)
    if h.dim() == 2 and is_quantised(e_proj) and out2 is not None:
        project(h_in, h_proj, out2, config=LINEAR_CONFIG)
        project(e_in, e_proj, out2, config=LINEAR_CONFIG, accumulate=True)
        return
    e_part, h_part = e.empty(), torch.empty_like(h2)
    project(e_in, e_proj, e_part, config=LINEAR_CONFIG)
    project(h_in, h_proj, h_part, config=LINEAR_CONFIG)
    torch.add(h_part.view(h.shape), e_part.unsqueeze(1) if h.dim() == 3 else e_part, out=out)


def _combiner_block_scaled(specs) -> str | None:
    quants = {s.quant for s in specs[4:6]} - {None}
    return None if quants <= {"fp8"} else f"no {sorted(quants)} GEMV kernel for e_proj / h_proj (FP8 only)"


combiner_impl.unsupported_block_scaled = _combiner_block_scaled


def _embed_combiner_block_scaled(specs) -> str | None:
    return _combiner_block_scaled(specs[1:])  # the table where the combiner's e is: the same positions after it


embed_combiner_impl.unsupported_block_scaled = _embed_combiner_block_scaled


def _readable(w, dtype: torch.dtype) -> bool:
    """A projection the GEMVs read: a dense FP8 QuantWeight, or a contiguous weight of the activations' dtype."""
    if is_quantised(w):
        return w.fmt == "fp8" and _dense(w)
    return w.dtype == dtype and w.is_contiguous()
