"""Draft selection on the device: draft_argmax, offset_positions, minimum.

draft_argmax is greedy drafting with the vocab limit and the optional grammar
bitmask applied on the device; it also returns the top-1 probability over the
allowed tokens, the chain's confidence. Nothing here syncs with the host: a
row with no allowed token yields token 0 and prob 0, and the caller (which
built the mask on the host) warns before staging it.
"""

from __future__ import annotations

import functools

import torch
from draftgraph.ops import constants
from draftgraph.ops.overlap import join_side_stream, side_stream
from draftgraph.ops.v4_shapes import batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec

WORD_BITS = 32


def _mask_words(vocab: int) -> int:
    return -(-vocab // WORD_BITS)


def _draft_argmax_infer(specs, attrs):
    expect(len(specs) in (2, 3), "draft_argmax inputs", "2 (logits, vocab_limit) or 3 (+ mask)", len(specs))
    logits, limit = specs[0], specs[1]
    expect_rank(logits, 2, "draft_argmax logits [B, V]")
    expect_spec(logits, logits.shape, torch.float32, "draft_argmax logits")
    b, vocab = logits.shape
    expect_spec(limit, (1,), torch.int32, "draft_argmax vocab_limit")
    if len(specs) == 3:
        expect_spec(specs[2], (b, _mask_words(vocab)), torch.int32, "draft_argmax mask")
    return [TensorSpec((b,), torch.int64), TensorSpec((b,), torch.float32)]


def blocked_tokens(vocab: int, limit: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B or 1, V] bool: t >= limit, or bit t % 32 of word t // 32 clear when a mask is given.

    The tokens a draft must not pick, so that one where against a constant [1] -inf applies
    them into a new tensor (an out-of-place masked_fill clones first, and a where against a
    Python -inf fills a device scalar first: one more kernel either way). The words
    are unpacked by one broadcast shift over [B, W, 32] in int32 (an arithmetic shift: bit 31
    comes down as -1, and & 1 keeps it), then viewed as [B, W*32] and cut to V: no int64
    index math over [B, V].
    """
    blocked = (constants.arange(0, vocab, torch.int32, limit.device) >= limit).unsqueeze(0)  # [1, V]
    if mask is None:
        return blocked
    shifts = constants.arange(0, WORD_BITS, torch.int32, mask.device)  # [32]
    clear = ((mask.unsqueeze(-1) >> shifts) & 1) == 0  # [B, W, 32]
    return clear.flatten(1)[:, :vocab] | blocked


@functools.cache
def vocab_chunks(vocab: int, target: int = 1024) -> int:
    """The divisor of ``vocab`` nearest ``vocab / target``: the row is reduced as [chunks, vocab / chunks].

    Why two stages: a reduction of one long row (B = 1) is one block's work in torch's
    reduce kernel (27 us for argmax over V-Flash's 129280 logits on an H200); cut into
    ~128 rows of ~1000 it spreads over the GPU, and the second stage is a few values.
    A prime vocab gives one chunk: the plain one-stage reduction.
    """
    want = max(1, round(vocab / target))
    divisors = [d for d in range(1, 4 * want + 1) if vocab % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), d))


def _draft_argmax_impl(inputs, outputs, attrs, workspace):
    logits = inputs[0]  # [B, V] fp32
    token, prob = outputs
    b, vocab = logits.shape
    chunks = vocab_chunks(vocab)
    blocked = blocked_tokens(vocab, inputs[1], inputs[2] if len(inputs) > 2 else None)
    masked = torch.where(blocked, constants.full(1, float("-inf"), logits.dtype, logits.device), logits)  # [B, V]
    # argmax keeps the lowest id among ties: max keeps the first of equal values within a
    # chunk and then among the chunks, whose ids ascend. A row with nothing allowed is all
    # -inf: id 0. A NaN logit wins, as in argmax.
    chunk_top, chunk_at = masked.view(b, chunks, vocab // chunks).max(-1)  # [B, chunks]
    top, which = chunk_top.max(-1, keepdim=True)  # [B, 1]
    # top-1 softmax probability = 1 / sum_t exp(l_t - max) over allowed t. A row with nothing
    # allowed gives exp(-inf - -inf) = NaN (so would a NaN logit): its confidence is 0.
    # On a side lane (draftgraph.ops.overlap) beside the token's two kernels; joined before the op ends.
    with side_stream():
        # Summed in two stages as the max (see vocab_chunks): one reduction over the row took
        # 14 us at B = 1 on an H200, against 6 for the two.
        total = masked.sub_(top).exp_().view(b, chunks, vocab // chunks).sum(-1).sum(-1)  # [B]
        torch.nan_to_num(total.reciprocal_(), nan=0.0, out=prob)
    torch.add(chunk_at.gather(1, which).squeeze(1), which.squeeze(1), alpha=vocab // chunks, out=token)
    join_side_stream()


DRAFT_ARGMAX = register(
    OpDef(
        name="draft_argmax",
        family="sample",
        infer=_draft_argmax_infer,
        impl=_draft_argmax_impl,
        output_names=("token", "prob"),
        doc="Greedy draft over tokens < vocab_limit (and set in the optional bitmask) + its top-1 prob.",
    )
)


# ---- offset_positions ----------------------------------------------------------


def _offset_infer(specs, attrs):
    expect_count(specs, 1, "offset_positions")
    require_attrs(attrs, ("offset",), "offset_positions")
    (pos,) = specs
    what = "offset_positions positions"
    expect_spec(pos, (batch_of(pos, what),), torch.int64, what)
    return [pos]


def _offset_impl(inputs, outputs, attrs, workspace):
    torch.add(inputs[0], int(attrs["offset"]), out=outputs[0])


OFFSET_POSITIONS = register(
    OpDef(
        name="offset_positions",
        family="sample",
        infer=_offset_infer,
        impl=_offset_impl,
        inplace={0: 0},
        doc="positions + offset, on the device (the K-draft chain advances positions this way).",
    )
)


# ---- minimum -------------------------------------------------------------------


def _minimum_infer(specs, attrs):
    expect_count(specs, 2, "minimum")
    a, b = specs
    expect_spec(a, (batch_of(a, "minimum a"),), torch.float32, "minimum a")
    expect_spec(b, a.shape, torch.float32, "minimum b")
    return [a]


def _minimum_impl(inputs, outputs, attrs, workspace):
    torch.minimum(inputs[0], inputs[1], out=outputs[0])


MINIMUM = register(
    OpDef(
        name="minimum",
        family="elementwise",
        infer=_minimum_infer,
        impl=_minimum_impl,
        inplace={0: 0},
        doc="Elementwise min of two f32[B] (the chain's running confidence).",
    )
)
