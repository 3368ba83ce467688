"""The named passes: pure, validated, and the passed chain computes what the declared chain does.

The declared chain says the math (the seven ops of each step); the passes make it fast. The
dump goldens (test_tools_dump.py) pin both graphs as printed; here: each pass leaves its input
alone, does exactly its rewrite, and the executors' graph drafts what the declared one drafts.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.graphs.v4_block import CacheGeometry
from draftgraph.runtime.errors import GraphError
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.serialize import from_json, to_json
from draftgraph.runtime.ir.validate import validate
from draftgraph.runtime.passes import DEFAULT_PASSES, parse_passes, run_passes
from draftgraph.runtime.passes.fold_embed_into_combiner import fold_embed_into_combiner
from draftgraph.runtime.passes.fold_hc_expand import fold_hc_expand
from draftgraph.runtime.passes.fold_norm_into_hc_pre import fold_norm_into_hc_pre
from draftgraph.runtime.passes.inline_subgraphs import inline_subgraphs
from draftgraph.runtime.passes.reuse_dying_inputs import reuse_dying_inputs
from draftgraph.runtime.passes.view_single_stacks import view_single_stacks
from proposer_fixtures import TINY, hidden, make_proposer

GEOMETRY = CacheGeometry(64, 4, 16)


def chain(num_drafts=2, mode="streams", **kw):
    return build_draft_chain(TINY, GEOMETRY, ChainSpec(num_drafts=num_drafts, mode=mode, **kw))


def ops_of(graph) -> list[str]:
    return [node.op for node in graph.nodes.values()]


@pytest.mark.parametrize("p", DEFAULT_PASSES, ids=lambda p: p.name)
def test_every_pass_leaves_its_input_unchanged(p):
    graph = inline_subgraphs(chain(num_drafts=1))[0] if p.name != "inline_subgraphs" else chain(num_drafts=1)
    before = to_json(graph)
    after, summary = p.run(graph)
    assert to_json(graph) == before, f"{p.name} edited its input graph"
    assert after is not graph and summary and "\n" not in summary
    validate(after)


def test_fold_hc_expand_folds_the_streams_embedding_only():
    flat, _ = inline_subgraphs(chain(num_drafts=3))
    folded, summary = fold_hc_expand(flat)
    assert ops_of(flat).count("hc_expand") == 3 and "hc_expand" not in ops_of(folded)
    assert summary == "3 hc_expand folded into the combiner's broadcast"
    combiners = [n for n in folded.nodes.values() if n.op == "combiner"]
    assert [folded.values[n.inputs[0]].spec.shape for n in combiners] == [("B", TINY.hidden_size)] * 3
    collapsed, _ = inline_subgraphs(chain(num_drafts=3, mode="collapsed"))
    same, summary = fold_hc_expand(collapsed)
    assert ops_of(same) == ops_of(collapsed) and summary == "no hc_expand feeds a combiner"


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_fold_embed_into_combiner_folds_each_step_s_embed(mode):
    """Each step's embed (the first token's, then each draft's argmax) now read by the combiner:
    the embed's inputs in e's place, op embed_combiner; in streams mode only once fold_hc_expand
    has removed the expand between them; an embedding row with a second reader is left alone."""
    flat, _ = inline_subgraphs(chain(num_drafts=3, mode=mode))
    expanded = fold_hc_expand(flat)[0]
    folded, summary = fold_embed_into_combiner(expanded)
    assert summary == "3 embed folded into the combiner after each"
    assert "embed" not in ops_of(folded) and ops_of(folded).count("embed_combiner") == 3
    for k in range(3):
        embed, node = expanded.nodes[f"d{k}.embed"], folded.nodes[f"d{k}.combiner"]
        assert node.inputs == (*embed.inputs, *expanded.nodes[f"d{k}.combiner"].inputs[1:])
        assert embed.outputs[0] not in folded.values
    if mode == "streams":  # the expand still between them: nothing to fold
        assert fold_embed_into_combiner(flat)[1] == "no embed feeds only a combiner"
    shared = expanded.copy()
    shared.outputs.append(expanded.nodes["d1.embed"].outputs[0])
    again, summary = fold_embed_into_combiner(shared)
    assert summary == "2 embed folded into the combiner after each" and again.nodes["d1.combiner"].op == "combiner"


def test_fold_norm_into_hc_pre_folds_each_norm_that_reads_an_hc_pre():
    """Each body's two halves (attn_norm, ffn_norm): the norm's output now made by hc_pre_norm,
    with the norm's weight as its fifth input and its eps as norm_eps; hc_head's y (read by the
    head's own norm inside lm_head) and a y with a second reader are left alone."""
    flat, _ = inline_subgraphs(chain(num_drafts=2))
    folded, summary = fold_norm_into_hc_pre(flat)
    assert summary == "4 rms_norm folded into the hc_pre before each"
    assert ops_of(flat).count("rms_norm") == 4 and "rms_norm" not in ops_of(folded)
    assert ops_of(folded).count("hc_pre_norm") == 4 and "hc_pre" not in ops_of(folded)
    node = folded.nodes["d0.body.hc_pre_attn"]
    norm = flat.nodes["d0.body.attn_norm"]
    assert node.inputs == (*flat.nodes["d0.body.hc_pre_attn"].inputs, norm.inputs[1])
    assert node.outputs[0] == norm.outputs[0] and folded.values[norm.outputs[0]].producer == node.name
    assert node.attrs["norm_eps"] == norm.attrs["eps"]
    assert flat.nodes["d0.body.hc_pre_attn"].outputs[0] not in folded.values
    # y read by another node too (the attention, in place of the norm's output), or a graph output: left alone
    y = flat.nodes["d0.body.hc_pre_attn"].outputs[0]
    shared = flat.copy()
    attn = shared.nodes["d0.body.attn"]
    attn.inputs = (y, *attn.inputs[1:])
    again, summary = fold_norm_into_hc_pre(shared)
    assert summary == "3 rms_norm folded into the hc_pre before each"
    assert again.nodes["d0.body.hc_pre_attn"].op == "hc_pre"
    exposed = flat.copy()
    exposed.outputs.append(y)
    again, summary = fold_norm_into_hc_pre(exposed)
    assert summary == "3 rms_norm folded into the hc_pre before each"
    assert again.nodes["d0.body.hc_pre_attn"].op == "hc_pre"


def test_view_single_stacks_turns_only_stacks_of_one_into_reshapes():
    one, _ = view_single_stacks(chain(num_drafts=1))
    assert [(one.nodes[n].op, one.nodes[n].attrs) for n in ("stacked_drafts", "probs")] == [
        ("reshape", {"shape": ["B", 1]}), ("reshape", {"shape": ["B", 1]})]
    three, summary = view_single_stacks(chain(num_drafts=3))
    assert three.nodes["stacked_drafts"].op == "stack" and summary == "no stack of one value"


def test_reuse_dying_inputs_marks_exactly_the_ops_that_declare_it():
    flat, _ = inline_subgraphs(chain(num_drafts=1))
    marked, summary = reuse_dying_inputs(flat)
    assert {n.op for n in marked.nodes.values() if n.may_reuse} == {"hc_post", "rms_norm", "mark_dropped"}
    assert not any(n.may_reuse for n in flat.nodes.values())
    assert summary == "5 nodes may write over a dying input (hc_post 2, rms_norm 2, mark_dropped 1)"


def test_may_reuse_on_an_op_without_an_inplace_output_is_refused():
    graph, _ = inline_subgraphs(chain(num_drafts=1))
    graph.nodes["d0.lm_head"].may_reuse = True
    with pytest.raises(GraphError, match="may_reuse: expected an op that declares an in-place output"):
        validate(graph)


def test_control_flow_survives_the_json_round_trip():
    lowered = run_passes(chain(num_drafts=3, conf_tau=0.5)).graph
    again = from_json(to_json(lowered))
    assert [(n.guard, n.may_reuse) for n in again.nodes.values()] == [
        (n.guard, n.may_reuse) for n in lowered.nodes.values()]
    assert any(n.guard for n in again.nodes.values()) and any(n.may_reuse for n in again.nodes.values())


def test_parse_passes():
    assert parse_passes("all") == DEFAULT_PASSES and parse_passes("none") == ()
    assert [p.name for p in parse_passes("reuse_dying_inputs, inline_subgraphs")] == [
        "inline_subgraphs", "reuse_dying_inputs"]  # the pipeline's order, whatever the order named
    with pytest.raises(GraphError, match="passes: expected 'all', 'none' or names from"):
        parse_passes("inline,fuse")


def test_a_pass_that_breaks_the_graph_is_named():
    from draftgraph.runtime.passes import Pass

    def drop_the_embed(graph):
        graph = graph.copy()
        del graph.nodes["d0.embed"]
        return graph, "dropped"

    with pytest.raises(GraphError, match="after pass drop_the_embed"):
        run_passes(chain(num_drafts=1), [Pass("drop_the_embed", drop_the_embed)])


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
@pytest.mark.parametrize("num_drafts", [1, 3])
def test_the_passed_chain_drafts_what_the_declared_chain_drafts(mode, num_drafts):
    """Eager, on CPU: the same drafts; the probabilities and hidden within bf16 rounding."""
    prop = make_proposer(TINY, mode=mode)
    graph = build_draft_chain(TINY, prop.geometry, ChainSpec(num_drafts=num_drafts, mode=mode))
    batch = 3
    gen = torch.Generator().manual_seed(7)
    inputs = {
        "token": torch.tensor([5, 17, TINY.vocab_size - 1]),
        "hidden": torch.stack([hidden(TINY, gen, mode=mode) for _ in range(batch)]),
        "positions": torch.tensor([0, 3, 9]),
        "kv_start": torch.zeros(batch, dtype=torch.int32),
        "block_table": torch.arange(batch * prop.geometry.max_blocks_per_seq, dtype=torch.int32).view(batch, -1),
        "vocab_limit": torch.tensor([TINY.vocab_size], dtype=torch.int32),
    }
    results = []
    for passes in ((), DEFAULT_PASSES):
        state = {k: v.clone() for k, v in prop.state_tensors.items()}
        executor = EagerExecutor(graph, batch, prop.weights, state, passes=passes, kernels="torch")
        results.append({k: v.clone() for k, v in executor.run(inputs).items()})
    declared, passed = results
    assert torch.equal(declared["drafts"], passed["drafts"])
    assert torch.allclose(declared["probs"], passed["probs"], rtol=1e-2, atol=1e-4)
    out = f"d{num_drafts - 1}.body" if mode == "streams" else f"d{num_drafts - 1}.hc_head"
    assert torch.allclose(declared[out].float(), passed[out].float(), rtol=2e-2, atol=2e-2)
