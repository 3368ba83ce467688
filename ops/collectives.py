"""Collectives as graph nodes: where the ranks of a sharded draft step talk.

- ``all_reduce_sum``: x summed over the ranks of a group, in place. The expert-parallel MoE
  (each rank computes its local experts' share of every row) and a row-parallel projection
  end in one.
- ``cast``: the one rounding after an fp32 reduction (the expert-parallel MoE sums its ranks'
  partials in fp32 and rounds once, as the unsharded MoE rounds its fp32 sum once).
- ``vocab_parallel_argmax``: ``draft_argmax`` over a vocab split in W equal slices, one per
  rank. Each rank reduces its slice to (max logit, its lowest global id, sum of exp(logit -
  max)) per row; one all-gather of those [B, 3] triples lets every rank pick the same token
  (the highest max; on a tie the lower rank, whose ids are lower, so the lowest id wins as in
  ``draft_argmax``) and the global top-1 probability: 1 / sum_r s_r * exp(m_r - M). The
  vocab limit and the grammar bitmask are global; each rank applies them to its own ids.

The group is not a tensor and not an attr: a node names it (``attrs["group"]``, printed by
the dump) and the executor is given the :class:`RankGroup` under that name (``runners=``,
as a body runner is), so one declared graph serves every rank. Nothing here syncs with the
host, so the nodes capture (NCCL collectives capture; gloo, the CPU backend, runs eagerly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from draftgraph.ops import constants
from draftgraph.ops.sampling import WORD_BITS, blocked_tokens
from draftgraph.ops.v4_shapes import batch_of, expect_spec, require_attrs
from draftgraph.runtime.errors import ExecutionError, InputError, describe
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec


def _unbound(inputs, outputs, attrs, workspace):
    raise ExecutionError(
        describe("collective group", "a RankGroup given to the executor", f"none for {attrs.get('group')!r}",
                 "pass runners={name: RankGroup(...)}")
    )


# ---- all_reduce_sum ----------------------------------------------------------------------------


def _all_reduce_infer(specs, attrs):
    expect_count(specs, 1, "all_reduce_sum")
    require_attrs(attrs, ("group",), "all_reduce_sum")
    expect(specs[0].dtype.is_floating_point, "all_reduce_sum x dtype", "a float dtype", specs[0].dtype)
    return [specs[0]]


ALL_REDUCE_SUM = register(
    OpDef(
        name="all_reduce_sum",
        family="comm",
        infer=_all_reduce_infer,
        impl=_unbound,
        inplace={0: 0},
        bound_by="group",
        doc="x summed over the ranks of attrs['group'] (the RankGroup the executor is given).",
    )
)


# ---- cast ----------------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _cast_infer(specs, attrs):
    expect_count(specs, 1, "cast")
    require_attrs(attrs, ("dtype",), "cast")
    expect(attrs["dtype"] in DTYPES, "cast dtype", " or ".join(DTYPES), attrs["dtype"])
    return [TensorSpec(specs[0].shape, DTYPES[attrs["dtype"]])]


def _cast_impl(inputs, outputs, attrs, workspace):
    outputs[0].copy_(inputs[0])


CAST = register(
    OpDef(name="cast", family="elementwise", infer=_cast_infer, impl=_cast_impl,
          doc="x rounded to attrs['dtype'] (bf16 / f16 / f32): after an fp32 all-reduce.")
)


# ---- vocab_parallel_argmax ---------------------------------------------------------------------


def _vocab_argmax_infer(specs, attrs):
    expect(len(specs) in (2, 3), "vocab_parallel_argmax inputs", "2 (logits, vocab_limit) or 3 (+ mask)",
           len(specs))
    require_attrs(attrs, ("group", "vocab"), "vocab_parallel_argmax")
    logits, limit = specs[0], specs[1]
    expect_rank(logits, 2, "vocab_parallel_argmax logits [B, V/W]")
    b = batch_of(logits, "vocab_parallel_argmax logits")
    expect_spec(logits, logits.shape, torch.float32, "vocab_parallel_argmax logits")
    vocab = int(attrs["vocab"])
    expect(vocab % logits.shape[1] == 0, "vocab_parallel_argmax slice", f"a divisor of the vocab {vocab}",
           logits.shape[1])
    expect_spec(limit, (1,), torch.int32, "vocab_parallel_argmax vocab_limit")
    if len(specs) == 3:
        expect_spec(specs[2], (b, -(-vocab // WORD_BITS)), torch.int32, "vocab_parallel_argmax mask")
    return [TensorSpec((b,), torch.int64), TensorSpec((b,), torch.float32)]


def _triples_bytes(logits: TensorSpec, attrs, batch: int) -> int:
    """Scratch for this rank's [B, 3] fp32 triples and the [W, B, 3] gathered ones (W = V / slice)."""
    world = int(attrs["vocab"]) // logits.shape[1]
    return (world + 1) * batch * 3 * 4


VOCAB_PARALLEL_ARGMAX = register(
    OpDef(
        name="vocab_parallel_argmax",
        family="comm",
        infer=_vocab_argmax_infer,
        impl=_unbound,
        output_names=("token", "prob"),
        bound_by="group",
        workspace=lambda specs, attrs, batch: _triples_bytes(specs[0], attrs, batch),
        doc="draft_argmax over a vocab sliced across the ranks of attrs['group']: (token, top-1 prob).",
    )
)


def slice_triples(logits: torch.Tensor, limit: torch.Tensor, mask: torch.Tensor | None, offset: int,
                  vocab: int) -> torch.Tensor:
    """[B, 3] fp32 per row of this rank's slice: (max allowed logit, its global id, sum exp(l - max)).

    A slice with nothing allowed gives (-inf, offset, 0): it never wins and adds nothing.
    Ids stay exact in fp32 up to 2^24 (V4's vocab is 129,280).
    """
    b, width = logits.shape
    if offset % WORD_BITS == 0 and width % WORD_BITS == 0:  # the slice owns whole mask words
        words = None if mask is None else mask[:, offset // WORD_BITS : (offset + width) // WORD_BITS]
        blocked = blocked_tokens(width, limit - offset, words)
    else:
        blocked = blocked_tokens(vocab, limit, mask)[:, offset : offset + width]
    masked = torch.where(blocked, constants.full(1, float("-inf"), logits.dtype, logits.device), logits)
    top, at = masked.max(-1, keepdim=True)  # the first of equal values: the lowest id
    total = (masked - top).exp().sum(-1, keepdim=True)
    total = torch.where(torch.isneginf(top), torch.zeros_like(total), total)
    return torch.cat([top, (at + offset).float(), total], dim=1)


def combine_triples(triples: torch.Tensor, token: torch.Tensor, prob: torch.Tensor) -> None:
    """[W, B, 3] gathered triples -> the global token (int64 [B]) and top-1 probability ([B])."""
    tops, ids, totals = triples.unbind(-1)  # [W, B] each
    best, rank = tops.max(0)  # ties: the lower rank, whose ids are lower
    token.copy_(ids.gather(0, rank.unsqueeze(0)).squeeze(0).to(torch.int64))
    # A row with nothing allowed on any rank: best = -inf, exp(nan) -> NaN -> confidence 0, token 0
    # (rank 0's offset), as draft_argmax gives.
    denominator = (totals * (tops - best).exp()).sum(0)
    torch.nan_to_num(denominator.reciprocal(), nan=0.0, out=prob)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankGroup:
    """A torch.distributed process group as the executor's implementation of the comm nodes.

    ``rank`` / ``world`` are this process's place in the group; the vocab slice of rank r is
    ``[r * V / W, (r + 1) * V / W)``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InputError(describe("torch.distributed", "an initialised process group",
                                      "none", "call torch.distributed.init_process_group first (torchrun)"))
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def run_all_reduce_sum(self, inputs, outputs, attrs, workspace) -> None:
        (x,), (out,) = inputs, outputs
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        dist.all_reduce(out, group=self.group)

    def run_vocab_parallel_argmax(self, inputs, outputs, attrs, workspace) -> None:
        logits, limit = inputs[0], inputs[1]
        mask = inputs[2] if len(inputs) > 2 else None
        token, prob = outputs
        width = logits.shape[1]
        if width * self.world != int(attrs["vocab"]):
            raise ExecutionError(describe("vocab_parallel_argmax slice", f"vocab / world = {attrs['vocab']} / "
                                          f"{self.world}", width))
        b = logits.shape[0]
        scratch = workspace.view(torch.float32)
        mine, gathered = scratch[: b * 3].view(b, 3), scratch[b * 3 :].view(self.world, b, 3)
        mine.copy_(slice_triples(logits, limit, mask, self.rank * width, int(attrs["vocab"])))
        # Into [W * B, 3] (the concatenated form: gloo takes no other); torch >= 2.13 renames the call.
        _all_gather(gathered.view(self.world * b, 3), mine, group=self.group)
        combine_triples(gathered, token, prob)

    def __repr__(self) -> str:
        return f"RankGroup(rank {self.rank} of {self.world})"
