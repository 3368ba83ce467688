"""The comm nodes on 2 and 4 ranks over gloo: what the unsharded ops give, on every rank.

vocab_parallel_argmax against draft_argmax on the whole logits (ties, a vocab limit inside a
slice and past a whole slice, a grammar mask, a row with nothing allowed), all_reduce_sum
against the sum of the ranks' inputs; both through the EagerExecutor with the RankGroup
given under the node's group name. A rank that raises before a collective makes every rank
fail within the collective timeout instead of hanging.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.ops.collectives import RankGroup
from draftgraph.ops.sampling import DRAFT_ARGMAX, WORD_BITS
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from rank_processes import results, run_ranks

VOCAB, BATCH = 256, 6


def _cases() -> list[dict]:
    """Whole-vocab logits, limits and masks, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, VOCAB, generator=g)
    logits[0, 5] = logits[0, 200] = 9.0  # a tie across slices: the lower id wins
    logits[1, 70] = logits[1, 71] = 9.0  # a tie inside one slice
    mask = torch.randint(-(2**31), 2**31 - 1, (BATCH, VOCAB // WORD_BITS), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[2] = 0  # nothing allowed in row 2
    return [
        {"logits": logits, "limit": VOCAB, "mask": None},
        {"logits": logits, "limit": 100, "mask": None},  # the limit inside rank 1 of 2
        {"logits": logits, "limit": 40, "mask": None},  # whole slices past the limit
        {"logits": logits, "limit": 230, "mask": mask},
    ]


def _graph(width: int, masked: bool):
    b = GraphBuilder("vocab_parallel")
    ins = [b.input("logits", TensorSpec((B, width), torch.float32)), b.input("limit", TensorSpec((1,), torch.int32))]
    if masked:
        ins.append(b.input("mask", TensorSpec((B, VOCAB // WORD_BITS), torch.int32)))
    token, prob = b.op("vocab_parallel_argmax", ins, attrs={"group": "tp", "vocab": VOCAB})
    partial = b.input("partial", TensorSpec((B, 8), torch.float32))
    b.output(token, prob, b.op("all_reduce_sum", [partial], attrs={"group": "tp"}))
    return b.build()


def _sharded(rank: int, world: int) -> list[tuple]:
    width = VOCAB // world
    out = []
    for case in _cases():
        masked = case["mask"] is not None
        ex = EagerExecutor(_graph(width, masked), BATCH, {}, runners={"tp": RankGroup()})
        inputs = {
            "logits": case["logits"][:, rank * width : (rank + 1) * width].contiguous(),
            "limit": torch.tensor([case["limit"]], dtype=torch.int32),
            "partial": torch.full((BATCH, 8), float(rank + 1)),
        }
        if masked:
            inputs["mask"] = case["mask"]
        got = ex.run(inputs)
        out.append(tuple(got[n].clone() for n in ex.graph.outputs))
    return out


def _fails_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise InputError("rank 1 refuses its input")
    _sharded(rank, world)  # the others wait in the first collective until its timeout


def _unsharded(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    token, prob = torch.empty(BATCH, dtype=torch.int64), torch.empty(BATCH)
    inputs = [case["logits"].clone(), torch.tensor([case["limit"]], dtype=torch.int32)]
    if case["mask"] is not None:
        inputs.append(case["mask"])
    DRAFT_ARGMAX.impl(inputs, [token, prob], {}, None)
    return token, prob


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_argmax_and_all_reduce_match_unsharded(tmp_path, world):
    per_rank = results(run_ranks(world, _sharded, folder=tmp_path))
    want_sum = float(sum(range(1, world + 1)))
    for case_index, case in enumerate(_cases()):
        token, prob = _unsharded(case)
        for rank in range(world):
            got_token, got_prob, reduced = per_rank[rank][case_index]
            assert torch.equal(got_token, token), (world, rank, case_index)
            # Summed in another order than the unsharded softmax: fp32 rounding only.
            torch.testing.assert_close(got_prob, prob, rtol=1e-5, atol=1e-7)
            assert torch.equal(reduced, torch.full((BATCH, 8), want_sum))
    assert _unsharded(_cases()[3])[1][2] == 0.0  # the row with nothing allowed: confidence 0


def test_a_failing_rank_fails_every_rank_without_hanging(tmp_path):
    outcomes = run_ranks(2, _fails_on_rank_one, folder=tmp_path, timeout=90)
    assert not outcomes[1]["ok"] and "rank 1 refuses" in outcomes[1]["error"]
    assert not outcomes[0]["ok"]  # the peer's collective timed out or saw the closed connection


def test_rank_group_needs_a_process_group():
    with pytest.raises(InputError, match="init_process_group"):
        RankGroup()
