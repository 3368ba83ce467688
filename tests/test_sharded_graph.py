"""The chain built for a ShardPlan: where the ranks talk, printed and pinned; a world of one is today's chain.

The sharded MoE is ``moe_shard`` (this rank's experts, fp32 partial) -> ``all_reduce_sum`` -> ``cast``;
the head is this rank's rows -> ``vocab_parallel_argmax``. One of each per step, nothing else talks.
moe_shard is checked against the unsharded ``moe`` in one process: the partials of every rank,
summed, are the whole MoE within fp32 rounding (the collective's own tests are in
test_collectives_gloo.py).
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain, build_drafter_prefill
from draftgraph.ops.moe import MOE, MOE_SHARD, local_pairs
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.runtime.ir.serialize import dumps, from_json
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.sharding import ShardPlan
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.binding import prepare_weights
from draftgraph.tools.chain_select import chain_geometry
from draftgraph.tools.cli import main
from golden_files import check_golden
from proposer_fixtures import TINY

SMALL = V4Config.small()
GEOMETRY = chain_geometry(SMALL)


def _comm_ops(graph) -> list[str]:
    return [n.op for n in flatten(graph).nodes.values() if get_op(n.op).family == "comm"]


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_each_step_talks_twice_the_moe_reduce_and_the_argmax(num_drafts):
    for rank in range(2):
        spec = ChainSpec(num_drafts=num_drafts, masked=True, mtp_vocab_size=640,
                         shard=ShardPlan.make(SMALL, rank, 2, 640))
        graph = build_draft_chain(SMALL, GEOMETRY, spec)
        assert _comm_ops(graph) == ["all_reduce_sum", "vocab_parallel_argmax"] * num_drafts
        weights = {v.name: v.spec for v in flatten(graph).values.values() if v.kind.name == "WEIGHT"}
        assert weights["head.weight"].shape == (320, SMALL.hidden_size)  # Vd / W rows
        assert weights["mtp.0.ffn.experts.stacked.w1"].shape[0] == SMALL.n_routed_experts // 2
        assert ("mtp.0.ffn.shared_experts.w1.weight" in weights) == (rank == 0)
        assert graph.meta["rank"] == rank and graph.meta["world"] == 2
    prefill = build_drafter_prefill(SMALL, GEOMETRY, shard=ShardPlan.make(SMALL, 1, 2))
    assert _comm_ops(prefill) == ["all_reduce_sum"]  # no head in the prefill


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_a_world_of_one_is_todays_chain(mode):
    plain = build_draft_chain(SMALL, GEOMETRY, ChainSpec(num_drafts=2, mode=mode))
    one = build_draft_chain(SMALL, GEOMETRY, ChainSpec(num_drafts=2, mode=mode, shard=ShardPlan.make(SMALL, 0, 1)))
    assert format_graph(one) == format_graph(plain) and dumps(one) == dumps(plain)
    assert _comm_ops(one) == []


def test_sharded_dump_golden(capsys):
    capsys.readouterr()
    assert main(["dump", "-k", "1", "--world", "2", "--rank", "1"]) == 0
    text = capsys.readouterr().out
    check_golden("dump_k1_streams_rank1of2.txt", text)
    assert "# comm %d0.body.moe_reduce = all_reduce_sum[group=tp]: 1024 bytes a rank at B=1" in text


def test_sharded_graph_round_trips_through_json():
    graph = build_draft_chain(SMALL, GEOMETRY, ChainSpec(num_drafts=2, shard=ShardPlan.make(SMALL, 1, 4)))
    assert format_graph(from_json(dumps(graph))) == format_graph(graph)


@pytest.mark.parametrize("argv, message", [(["--world", "3"], "routed experts"), (["--world", "2", "--rank", "2"],
                                                                                    "shard rank")])
def test_dump_refuses_a_world_that_does_not_split(capsys, argv, message):
    assert main(["dump", *argv]) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_partials_sum_to_the_whole_moe(world, batch):
    weights = random_mtp_weights(TINY, seed=1)
    whole = prepare_weights(TINY, weights, torch.device("cpu"))
    f = "mtp.0.ffn."
    names = ["gate.weight", "gate.bias", "experts.stacked.w1", "experts.stacked.w2", "experts.stacked.w3",
             "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight"]
    x = torch.randn(batch, TINY.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    attrs = {"top_k": TINY.num_experts_per_tok, "routed_scaling_factor": float(TINY.routed_scaling_factor),
             "swiglu_limit": float(TINY.swiglu_limit)}
    want = torch.empty(batch, TINY.hidden_size, dtype=torch.bfloat16)
    MOE.impl([x, *(whole[f + n] for n in names)], [want], attrs, None)
    total = torch.zeros(batch, TINY.hidden_size)
    for rank in range(world):
        plan = ShardPlan.make(TINY, rank, world)
        held = prepare_weights(TINY, weights, torch.device("cpu"), shard=plan)
        inputs = [x, *(held[f + n] for n in names if f + n in held)]
        part = torch.empty(batch, TINY.hidden_size)
        ws = torch.empty(batch * TINY.hidden_size * 2, dtype=torch.uint8) if plan.holds_shared else None
        MOE_SHARD.impl(inputs, [part], attrs | {"expert_start": plan.expert_start}, ws)
        total += part
    torch.testing.assert_close(total.bfloat16().float(), want.float(), rtol=2**-7, atol=1e-5)


def test_other_ranks_pairs_weigh_nothing_and_read_a_held_expert():
    idx = torch.tensor([[0, 5], [6, 7], [2, 4]])  # rank 1 of 2 holds experts 4..7
    weights = torch.tensor([[0.3, 0.7], [0.5, 0.5], [0.9, 0.1]])
    local, w = local_pairs(idx, weights, 4, 4)
    assert local.tolist() == [[1, 1], [2, 3], [0, 0]]  # row 0's expert 0 reads its expert 5 (local 1)
    assert torch.equal(w, torch.tensor([[0.0, 0.7], [0.5, 0.5], [0.0, 0.1]]))


def test_drawn_the_comm_nodes_take_the_comm_colour(capsys):
    from draftgraph.tools.colors import FAMILY_COLORS

    capsys.readouterr()
    assert main(["dump", "-k", "1", "--world", "2", "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    comm = [line for line in dot.splitlines() if "all_reduce_sum" in line or "vocab_parallel_argmax" in line]
    assert comm and all(FAMILY_COLORS["comm"] in line for line in comm if "label=" in line and "->" not in line)
    assert sum(FAMILY_COLORS["comm"] in line for line in dot.splitlines()) >= 2
