"""``draftgraph dump``: golden text dumps, JSON round trip, DOT sanity.

The text dumps are pinned by golden files in tests/golden/. After an intended
change to the printer, the chain or the planner, regenerate them with

    UPDATE_GOLDEN=1 python -m pytest tests/test_tools_dump.py

and review the diff before committing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.runtime.ir.serialize import from_json
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.passes import run_passes
from draftgraph.tools.chain_select import chain_geometry
from draftgraph.tools.cli import main
from golden_files import check_golden


def dump(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["dump", *argv]) == 0
    return capsys.readouterr().out


# ---- text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_text_dump_golden(capsys, num_drafts):
    text = dump(capsys, "-k", str(num_drafts), "--batch", "1", "--mode", "streams")
    check_golden(f"dump_k{num_drafts}_streams_b1.txt", text)


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_declared_dump_golden(capsys, mode):
    """``--passes none``: the graph as the builder declared it, the body's V4 block nested."""
    text = dump(capsys, "-k", "1", "--passes", "none", "--mode", mode)
    check_golden(f"dump_k1_{mode}_declared.txt", text)
    assert not text.startswith("# pass")


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_each_declared_step_has_the_seven_ops_of_the_design(capsys, mode):
    lines = [line for line in dump(capsys, "-k", "2", "--passes", "none", "--mode", mode).splitlines()
             if line.startswith("  %d")]
    for k in range(2):
        ops = [re.match(r".* = (\w+)", line).group(1) for line in lines if line.startswith(f"  %d{k}.")]
        ops = [op for op in ops if op != "offset_positions"]
        expand_first = mode == "streams"  # the embedding meets the streams; collapsed expands the sum
        middle = ["hc_expand", "combiner"] if expand_first else ["combiner", "hc_expand"]
        assert ops == ["embed", *middle, "body", "hc_head", "lm_head", "draft_argmax"], ops


def test_the_default_dump_says_what_each_pass_did(capsys):
    lines = dump(capsys, "-k", "1").splitlines()
    passes = [line for line in lines if line.startswith("# pass ")]
    assert [p.split(":")[0] for p in passes] == ["# pass inline_subgraphs", "# pass fold_hc_expand",
                                                 "# pass fold_embed_into_combiner", "# pass fold_norm_into_hc_pre",
                                                 "# pass view_single_stacks", "# pass reuse_dying_inputs"]  # fmt: skip
    assert passes[1] == "# pass fold_hc_expand: 1 hc_expand folded into the combiner's broadcast"
    assert passes[2] == "# pass fold_embed_into_combiner: 1 embed folded into the combiner after it"
    assert passes[3] == "# pass fold_norm_into_hc_pre: 2 rms_norm folded into the hc_pre before each"
    assert not any("= hc_expand" in line or "= rms_norm" in line or "= embed(" in line for line in lines)
    collapsed = dump(capsys, "-k", "1", "--mode", "collapsed")
    assert "# pass fold_hc_expand: no hc_expand feeds a combiner" in collapsed and "= hc_expand" in collapsed
    assert "# pass fold_embed_into_combiner: 1 embed folded into the combiner after it" in collapsed


def test_passes_can_be_named(capsys):
    text = dump(capsys, "-k", "1", "--passes", "inline_subgraphs")
    assert [line for line in text.splitlines() if line.startswith("# pass")] == [
        "# pass inline_subgraphs: 1 subgraph inlined (8 nodes)"]
    assert "= hc_expand" in text and "may reuse" not in text and text.rstrip().endswith("at B=1")


def test_unknown_passes_are_a_one_line_usage_error(capsys):
    assert main(["dump", "--passes", "fuse_everything"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "passes" in err and "fuse_everything" in err, err


def test_text_dump_has_arena_comments_and_summary(capsys):
    lines = [line for line in dump(capsys, "-k", "1").splitlines() if not line.startswith("# pass")]
    assert lines[0].startswith("graph mtp_chain_k1_streams(")
    assert re.search(r"^arena .* at B=1$", lines[-1]), lines[-1]
    combiner = next(line for line in lines if "= embed_combiner[" in line)
    assert re.search(r"# arena \+0x[0-9a-f]+ \d", combiner), combiner
    assert any("free %" in line for line in lines)


def test_dump_out_file_and_runner_graph(capsys, tmp_path):
    out = tmp_path / "k2.txt"
    assert main(["dump", "-k", "2", "--runner", "identity", "--mode", "collapsed", "--out", str(out)]) == 0
    text = out.read_text()
    assert "= body[runner=identity, workspace_bytes=0](" in text, text[:400]
    assert "d1.body" in text and text.rstrip().endswith("at B=1")


def test_bad_selector_is_a_one_line_usage_error(capsys):
    assert main(["dump", "-k", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--num-drafts" in err and "got 0" in err, err


# ---- json -----------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["builtin", "identity"])
def test_json_round_trip_equals_built_graph(capsys, runner):
    config = V4Config.small()
    built = build_draft_chain(config, chain_geometry(config), ChainSpec(num_drafts=3, runner=runner))
    declared = from_json(dump(capsys, "--format", "json", "-k", "3", "--runner", runner, "--passes", "none"))
    assert declared == built
    assert flatten(declared) == flatten(built)
    assert declared.meta["num_drafts"] == 3 and declared.meta["runner"] == runner
    passed = from_json(dump(capsys, "--format", "json", "-k", "3", "--runner", runner))
    assert passed == run_passes(built).graph and not passed.has_subgraphs()


# ---- dot ------------------------------------------------------------------------------------

QUOTED = r'"(?:[^"\\]|\\.)*"'


def parse_dot(text: str) -> tuple[set[str], list[tuple[str, str]], list[str]]:
    """A small DOT reader: (declared node ids, edges, cluster names); asserts the braces balance."""
    unquoted = re.sub(QUOTED, '""', text)
    depth = 0
    for ch in unquoted:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0, "a '}' closes nothing"
    assert depth == 0, f"{depth} unclosed '{{'"
    nodes, edges, clusters = set(), [], []
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(rf"({QUOTED})\s*->\s*({QUOTED})", line):
            edges.append((m.group(1), m.group(2)))
        elif m := re.match(rf"subgraph\s+({QUOTED})\s*{{", line):
            clusters.append(m.group(1)[1:-1])
        elif m := re.match(rf"({QUOTED})\s*\[", line):
            nodes.add(m.group(1))
    return nodes, edges, clusters


def test_dot_is_well_formed(capsys, tmp_path):
    text = dump(capsys, "--format", "dot", "-k", "3")
    nodes, edges, clusters = parse_dot(text)
    assert text.startswith("digraph ")
    undeclared = {end for edge in edges for end in edge} - nodes
    assert not undeclared, f"edge endpoints never declared: {sorted(undeclared)[:5]}"
    assert {"cluster_d0.body", "cluster_d1.body", "cluster_d2.body"} <= set(clusters), clusters
    assert '"n:d0.body.attn"' in nodes and len(edges) > 100
    if shutil.which("dot"):  # the real parser, when Graphviz is installed
        svg = tmp_path / "chain.svg"
        subprocess.run(["dot", "-Tsvg", "-o", str(svg)], input=text.encode(), check=True)
        assert ET.parse(svg).getroot().tag.endswith("svg")


def test_dot_colours_are_stable_by_family(capsys):
    from draftgraph.tools.colors import family_color

    text = dump(capsys, "--format", "dot", "-k", "1")
    attn = next(line for line in text.splitlines() if line.strip().startswith('"n:d0.body.attn"'))
    assert f'fillcolor="{family_color("attention")}"' in attn, attn
    moe = next(line for line in text.splitlines() if line.strip().startswith('"n:d0.body.moe"'))
    assert f'fillcolor="{family_color("moe")}"' in moe, moe


def test_dot_labels_break_lines_with_a_single_backslash(capsys):
    text = dump(capsys, "--format", "dot", "-k", "1")
    combiner = next(line for line in text.splitlines() if line.strip().startswith('"n:d0.combiner"'))
    assert 'label="combiner\\nembed_combiner' in combiner, combiner
