"""validate() rejects each kind of malformed graph with a message naming the node."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.errors import GraphError
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.graph import Node, Value, ValueKind
from draftgraph.runtime.ir.schedule import schedule
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.runtime.ir.validate import validate

F32 = torch.float32


def chain(n: int = 4):
    b = GraphBuilder("chain")
    x = b.input("x", TensorSpec((B, 8), F32))
    w = b.weight("w", TensorSpec((8, 8), F32))
    for i in range(n):
        x = b.op("linear", [x, w], name=f"l{i}")
    b.output(x)
    return b.build()


def assert_short_error(graph, *fragments):
    with pytest.raises(GraphError) as info:
        validate(graph)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, text
    assert len(text.splitlines()) <= 10, f"error message too long:\n{text}"
    return text


def test_valid_graph_passes_and_schedules_in_builder_order():
    graph = chain()
    validate(graph)
    assert [n.name for n in schedule(graph)] == ["l0", "l1", "l2", "l3"]


def test_cycle_is_named():
    graph = chain()
    graph.nodes["l0"].inputs = ("l2", "w")  # l0 now reads l2, which depends on l0
    text = assert_short_error(graph, "cycle", "%l0")
    assert "%l1" in text


def test_undefined_value_names_node():
    graph = chain()
    graph.nodes["l2"].inputs = ("ghost", "w")
    assert_short_error(graph, "%l2", "%ghost is undefined")


def test_doubly_defined_value_names_both_nodes():
    graph = chain()
    graph.nodes["dup"] = Node("dup", "linear", ("x", "w"), ("l1",), {})
    assert_short_error(graph, "%dup", "%l1 is defined twice", "%l1")


def test_dangling_output_is_rejected():
    b = GraphBuilder("dangle")
    x = b.input("x", TensorSpec((B, 8), F32))
    w = b.weight("w", TensorSpec((8, 8), F32))
    b.op("linear", [x, w], name="unused")
    y = b.op("linear", [x, w], name="used")
    b.output(y)
    with pytest.raises(GraphError, match="dangling output %unused"):
        b.build()


def test_discarded_output_is_allowed():
    b = GraphBuilder("discard")
    x = b.input("x", TensorSpec((B, 8), F32))
    w = b.weight("w", TensorSpec((8, 8), F32))
    b.discard(b.op("linear", [x, w], name="unused"))
    b.output(b.op("linear", [x, w], name="used"))
    validate(b.build())


def test_shape_rule_violation_after_build_is_caught():
    graph = chain()
    graph.values["l1"].spec = TensorSpec((B, 9), F32)
    assert_short_error(graph, "%l", "expected")


def test_builder_rejects_bad_shapes_immediately_with_expected_and_got():
    b = GraphBuilder("bad")
    x = b.input("x", TensorSpec((B, 8), F32))
    w = b.weight("w", TensorSpec((4, 6), F32))
    with pytest.raises(GraphError) as info:
        b.op("linear", [x, w], name="proj")
    text = str(info.value)
    assert "%proj" in text and "expected" in text and "f32[B,8]" in text


def test_dtype_rule_violation():
    b = GraphBuilder("dtype")
    x = b.input("x", TensorSpec((B, 8), torch.bfloat16))
    w = b.weight("w", TensorSpec((8, 8), F32))
    with pytest.raises(GraphError, match="linear dtypes"):
        b.op("linear", [x, w])


def test_node_writing_a_weight_is_rejected():
    graph = chain()
    graph.values["w2"] = Value("w2", TensorSpec((8, 8), F32), ValueKind.WEIGHT)
    graph.nodes["l3"].outputs = ("w2",)
    graph.outputs = ["l2"]
    assert_short_error(graph, "%l3", "weight")


def test_error_window_shows_neighbours_not_whole_graph():
    graph = chain(30)
    graph.nodes["l15"].inputs = ("nope", "w")
    text = assert_short_error(graph, "%l15")
    assert "%l16" in text  # its consumer is shown
    assert "%l3:" not in text and "%l27:" not in text  # far-away nodes are not


@pytest.mark.parametrize("dtype", ["float32", torch.complex64, None])
def test_a_spec_dtype_the_printer_cannot_name_is_a_graph_error(dtype):
    """A string or an unnamed dtype was a KeyError from the printer's table, later, where the spec was shown."""
    with pytest.raises(GraphError, match=r"TensorSpec dtype: expected a torch\.dtype of .*'f32'.*got"):
        TensorSpec((B, 8), dtype)


@pytest.mark.parametrize("graph_ok, batch, match", [
    (False, 2, r"graph: expected a Graph .*got NoneType"),
    (True, 0, r"batch: expected an int >= 1, got 0"),
    (True, -1, r"batch: expected an int >= 1, got -1"),
    (True, True, r"batch: expected an int >= 1, got True"),
    (True, 2.0, r"batch: expected an int >= 1, got 2\.0"),
])
def test_the_eager_executor_refuses_no_graph_and_no_batch(graph_ok, batch, match):
    """Were an AttributeError (no graph) and a plan of empty or negative buffers (batch < 1)."""
    from draftgraph.runtime.errors import InputError
    from draftgraph.runtime.execution.eager import EagerExecutor

    weights = {"w": torch.zeros(8, 8)}
    with pytest.raises(InputError, match=match):
        EagerExecutor(chain() if graph_ok else None, batch, weights, device="cpu")
    import numpy as np

    assert EagerExecutor(chain(), np.int64(2), weights, device="cpu").batch == 2  # numpy ints count as ints


@pytest.mark.parametrize("build, fragment", [
    (lambda b, x, w: GraphBuilder(3), "graph name: expected a non-empty str, got 3"),
    (lambda b, x, w: b.input("", TensorSpec((B, 8), F32)), "input name: expected a non-empty str, got ''"),
    (lambda b, x, w: b.input("y", (B, 8)), "input 'y' spec: expected a TensorSpec, got tuple"),
    (lambda b, x, w: b.op("linear", [x, "w"]), "linear inputs: expected values the builder made"),
    (lambda b, x, w: b.op("linear", x), "linear inputs: expected a sequence of values the builder made, got Value"),
    (lambda b, x, w: b.op(None, [x, w]), "op name: expected a non-empty str, got None"),
    (lambda b, x, w: b.output(None), "outputs: expected values the builder made"),
    (lambda b, x, w: b.subgraph("s", None, [x]), "subgraph 's': expected a Graph"),
], ids=["graph name", "empty name", "spec a tuple", "input a str", "inputs one value", "op None", "output None",
        "subgraph None"])
def test_builder_misuse_is_a_graph_error(build, fragment):
    """Each was an AttributeError or TypeError from inside the builder (a fuzz of its calls)."""
    b = GraphBuilder("misuse")
    x = b.input("x", TensorSpec((B, 8), F32))
    w = b.weight("w", TensorSpec((4, 8), F32))
    with pytest.raises(GraphError) as info:
        build(b, x, w)
    assert fragment in str(info.value)
