"""Golden tests of the one printer, JSON round trip and DOT, on small fixed graphs.

Regenerate the golden files after a deliberate printer or planner change with
``UPDATE_GOLDEN=1 pytest tests/test_printer_golden.py`` and review the diff.
"""

from __future__ import annotations

import json

import networkx as nx
import torch
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.dot import to_dot
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.ir.serialize import from_json, to_json
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.runtime.passes import run_passes
from draftgraph.runtime.planning.graph_plan import plan_graph
from golden_files import check_golden

F32, BF16 = torch.float32, torch.bfloat16


def mlp_graph():
    b = GraphBuilder("mlp")
    x = b.input("x", TensorSpec((B, 64), BF16))
    g = b.weight("norm.weight", TensorSpec((64,), BF16))
    w1 = b.weight("w1", TensorSpec((256, 64), BF16))
    w2 = b.weight("w2", TensorSpec((64, 256), BF16))
    h = b.op("rms_norm", [x, g], name="norm", attrs={"eps": 1e-6})
    up = b.op("linear", [h, w1], name="up")
    gated = b.op("mul", [up, up], name="square")
    down = b.op("linear", [gated, w2], name="down")
    res = b.op("add", [down, x], name="residual")
    folded = b.op("reshape", [res], name="fold", attrs={"shape": [B, 4, 16]})
    probs = b.op("softmax", [folded], name="probs")
    b.output(probs)
    return b.build()


def test_printer_golden_unplanned():
    check_golden("ir_mlp.txt", format_graph(mlp_graph()) + "\n")


def test_printer_golden_planned():
    graph = run_passes(mlp_graph()).graph  # what the executors plan: in-place reuse allowed
    text = format_graph(graph, plan_graph(graph, 2))
    check_golden("ir_mlp_planned_b2.txt", text + "\n")
    assert "in place of %" in text and "view of %" in text and "free %" in text
    assert text.splitlines()[-1].startswith("arena ")


def test_repr_is_the_printer():
    graph = mlp_graph()
    assert repr(graph) == format_graph(graph)


def test_json_round_trip_is_lossless():
    graph = mlp_graph()
    data = json.loads(json.dumps(to_json(graph)))
    again = from_json(data)
    assert again == graph
    assert format_graph(again) == format_graph(graph)
    assert again.nodes["norm"].attrs == {"eps": 1e-6}


def test_dot_parses_into_the_same_structure():
    text = to_dot(mlp_graph())
    assert text.count("{") == text.count("}")
    edges = [line for line in text.splitlines() if "->" in line]
    declared = {line.split()[0] for line in text.splitlines() if "[label=" in line and "->" not in line}
    for edge in edges:
        src, _, rest = edge.strip().partition(" -> ")
        dst = rest.split(" [")[0].rstrip(";")
        assert src in declared and dst in declared, edge
    g = nx.DiGraph()
    for edge in edges:
        src, _, rest = edge.strip().partition(" -> ")
        g.add_edge(src, rest.split(" [")[0].rstrip(";"))
    assert nx.is_directed_acyclic_graph(g)
